# Scoring profile of the default model, Gemma 3 270M Q4_K_M (fitmd --profile, or beside the
# model as gemma-3-270m-q4_k_m.profile). Same syntax as config/fitmd.conf.
# Interim: the recipe the first dev-split measurements favour (question rows, the global layers
# 5/11/17, sum, the trailing query replaced by "N/A" as reference on the prompt's cache:
# AUC 1.00 on 5 dev items where raw last-row attention had 0.72), not yet the full fit; the
# fitted profile replaces this file (tools/fit_profile.py, see docs/).
profile_version = 1
model_architecture = "gemma3"
model_name = "Gemma 3 270m"
model_layers = 18
model_embd = 640
model_heads = 4
model_vocab = 262144
model_file_bytes = 253113024
fitted_on = "not fitted: tests/quality/data/dev.jsonl plain K=10, n = 5 (oracle captures, tools/scoring_capture.py)"
fitted_metrics = "dev n=5: AUC 1.00, R@1 1/1/1 at gold 1/5/10 (question rows, null_suffix, 5/11/17)"

rows = question
layers = 5,11,17
aggregate = sum
skip_first = 0
reference = null_suffix
form = difference
sink_factor = 0
window = 0
temperature = 0.05
