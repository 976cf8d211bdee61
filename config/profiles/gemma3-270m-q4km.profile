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
fitted_on = "tests/quality/data/dev.jsonl, 72 items (groups 0-5); scores from fitmd; tools/fit_profile.py --model MODEL --daemon '{"rows":"question","aggregate":"sum","skip_first":0,"sink_factor":0,"reference":"null_suffix","form":"difference","window":1,"layers":[3,4,5,6,7,8,9,10,11],"temperature":0.05}' --groups 6 --answer '{"calibrate":false,"reorder":"calibrated","reorder_placement":"last"}' --out config/profiles/gemma3-270m-q4km.profile"
fitted_metrics = "dev: hard K10 p1: n=6 R@1 1.00 R@3 1.00; hard K10 p5: n=6 R@1 1.00 R@3 1.00; hard K10 p10: n=6 R@1 1.00 R@3 1.00; hard K20 p1: n=6 R@1 1.00 R@3 1.00; hard K20 p10: n=6 R@1 1.00 R@3 1.00; hard K20 p20: n=6 R@1 1.00 R@3 1.00; plain K10 p1: n=6 R@1 1.00 R@3 1.00; plain K10 p5: n=6 R@1 1.00 R@3 1.00; plain K10 p10: n=6 R@1 1.00 R@3 1.00; plain K20 p1: n=6 R@1 1.00 R@3 1.00; plain K20 p10: n=6 R@1 1.00 R@3 1.00; plain K20 p20: n=6 R@1 1.00 R@3 1.00"

# scoring options (the /rerank request fields of the same names)
rows = "question"
aggregate = "sum"
skip_first = 0
sink_factor = 0
reference = "null_suffix"
form = "difference"
window = 1
layers = 3,4,5,6,7,8,9,10,11

# relevance_score = sigmoid(score_scale * rel_scaled + score_bias)
score_scale = 217.728
score_bias = -16.8394
temperature = 0.05

# /rerank's method for requests that name none, and fused's weight (chosen on the plain, hard
# and trap dev splits, docs/scoring.md); its fuse_layers are the built-in 0
rerank_method = fused
fuse_weight = 0.02
# fused's relevance_score = sigmoid(fuse_scale x score + fuse_bias), fitted on the dev
# splits (tests/quality/fuse_sweep.py --fit)
fuse_scale = 3.06908
fuse_bias = 6.35162

# /answer defaults for requests that leave them out (the request fields of the same names, chosen with tests/quality/quality.py --answer on the dev split)
# answer_reorder: since chosen, rerank_method's, the default ranking
answer_calibrate = false
answer_reorder = fused
answer_reorder_placement = last
# answer_top_n: chosen after the fit, on the trap dev splits (docs/answer-results.md)
answer_top_n = 3
