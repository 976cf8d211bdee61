# Scoring profile of the default model, Gemma 3 270M Q4_K_M (fitmd --profile, or beside the
# model as gemma-3-270m-q4_k_m.profile). Same syntax as config/fitmd.conf.
# Interim: the best recipe of issue 9's exploration (question rows, layers 5-7, sum, the
# content-free "N/A" query as reference), not yet fitted on the project's own dev split; the
# fitted profile replaces this file (tools/fit_profile.py, see docs/).
profile_version = 1
model_architecture = "gemma3"
model_name = "Gemma 3 270m"
model_layers = 18
model_embd = 640
model_heads = 4
model_vocab = 262144
model_file_bytes = 253113024
fitted_on = "not fitted: issue 9's table (synthetic companies/towns/ships, dev half, n = 24 per cell)"
fitted_metrics = "issue 9: R@1/R@3 gold 1 .67/.96, gold 5 .21/.46, gold 10 .83/1.0; 1.85k forward tokens"

rows = question
layers = 5,6,7
aggregate = sum
skip_first = 0
reference = null_query
form = difference
sink_factor = 0
window = 0
temperature = 0.05
