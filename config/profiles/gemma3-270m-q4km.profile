# fitm scoring profile: written by tools/fit_profile.py (docs/scoring-profile.md)
# identity: fitmd refuses this profile for any other model
profile_version = 1
model_architecture = "gemma3"
model_name = "Gemma 3 270m"
model_layers = 18
model_embd = 640
model_heads = 4
model_vocab = 262144
model_file_bytes = 253113024

# provenance
fitted_on = "tests/quality/data/dev.jsonl, 5 captured items (plain K10); numpy oracle float32; tools/fit_profile.py --model MODEL --cache /tmp/i9r/cap --layers 5 11 17 --out config/profiles/gemma3-270m-q4km.profile --report /tmp/i9r/report.json"
fitted_metrics = "dev: plain K10 p1: n=2 R@1 1.00 R@3 1.00; plain K10 p5: n=2 R@1 1.00 R@3 1.00; plain K10 p10: n=1 R@1 1.00 R@3 1.00"

# scoring options (the /rerank request fields of the same names)
rows = "question"
aggregate = "sum"
skip_first = 0
sink_factor = 0
reference = "null_suffix"
form = "difference"
window = 0
layers = 5,11,17

# relevance_score = sigmoid(score_scale * rel_scaled + score_bias)
score_scale = 17.261
score_bias = -4.49968
temperature = 0.05
