"""Mutation check: how hard the suite bites. Plants each small bug of MUTANTS, one at a time, in
a scratch copy of the working tree (never in the tree itself), rebuilds, runs the tests that
should notice, and reports which tests caught each bug. Exit status 1 when a bug went uncaught,
or when the unmutated copy does not pass those tests to begin with.

Each bug is located by a snippet of code searched in every file under src/ and kernels/ (so
files may move between folders); the snippet must occur exactly once. The kernel mutants are
caught by the kernel tests run on the CPU emulator (tests/cuda_emu), so no GPU is needed.

    python3 tests/mutate.py                  # every mutant (about 10 minutes on 2 cores)
    python3 tests/mutate.py answer-late-intervention rerank-one-doc-uncalibrated
    python3 tests/mutate.py --list

The scratch copy finds the test data as the suite does (tests/testdata.py); ../shared/data
beside this checkout is passed on as FITM_SHARED_DATA when that is not set."""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclass
class Mutant:
    name: str
    why: str          # the bug, in words
    snippet: str      # code found exactly once under src/
    replacement: str  # what the snippet becomes
    meson: list = field(default_factory=list)   # meson test names
    pytest: list = field(default_factory=list)  # pytest arguments (paths, -k expressions)


MUTANTS = [
    Mutant("rerank-no-per-token-mean",
           "A_k sums the span's attention instead of averaging it per token",
           "double div = o->aggregate == FITM_AGG_MEAN ? (double)counted : 1.0;",
           "double div = 1.0;",
           pytest=["tests/test_http_oracle.py"]),
    Mutant("rerank-one-doc-uncalibrated",
           "the first document is scored by A instead of A - A_dum",
           "sc->rel[k] = fitm_score_rel(o->form, A, Ar);",
           "sc->rel[k] = fitm_score_rel(o->form, A, k == 0 ? 0.0 : Ar);",
           pytest=["tests/test_http_oracle.py"]),
    Mutant("rerank-part-logits-at-pass-start",
           "a batched part that starts inside a pass's logit rows writes its log-probabilities "
           "over the pass's first ones",
           "        .logprob = n_logits ? p->logprob + at * p->n_pick : NULL,\n"
           "        .position = p->position,",
           "        .logprob = n_logits ? p->logprob : NULL,\n"
           "        .position = p->position,",
           pytest=["tests/test_batching.py", "-k", "concurrent_reranks or whole_run"]),
    Mutant("fused-weight-dropped",
           "fused's score is query likelihood alone, the attention's z-score dropped",
           "res[k].raw_score = res[k].raw_score + pd->w * z;",
           "res[k].raw_score = res[k].raw_score + 0.0 * pd->w * z;",
           pytest=["tests/test_http_scoring.py", "-k", "fused"]),
    Mutant("question-span-off-by-one",
           "the rows of the trailing question start one token late",
           "*span = (fitm_span){.start = s, .end = ids->n};",
           "*span = (fitm_span){.start = s + 1, .end = ids->n};",
           pytest=["tests/test_http_oracle.py"]),
    Mutant("intervention-no-constant-C",
           "Eq. 5's constant C (the visible mass over sum n_k alpha_k) dropped",
           "double C = S / Z;", "double C = 1.0 + 0.0 * S / Z;",
           pytest=["tests/test_model.py", "-k", "intervention"]),
    Mutant("q4k-scale-off-by-one",
           "Q4_K dequantization reads the next sub-block's scale for the low nibbles",
           "fitm_quant_k_scale_min(b->scales, 2 * g, &sc0, &m0);\n"
           "        fitm_quant_k_scale_min(b->scales, 2 * g + 1, &sc1, &m1);\n"
           "        const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;\n"
           "        const uint8_t *q = b->qs + 32 * g;\n"
           "        for (int l = 0; l < 32; l++) {\n"
           "            y[64 * g + l] = d0 * (float)(q[l] & 0xF) - o0;",
           "fitm_quant_k_scale_min(b->scales, (2 * g + 1) % 8, &sc0, &m0);\n"
           "        fitm_quant_k_scale_min(b->scales, 2 * g + 1, &sc1, &m1);\n"
           "        const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;\n"
           "        const uint8_t *q = b->qs + 32 * g;\n"
           "        for (int l = 0; l < 32; l++) {\n"
           "            y[64 * g + l] = d0 * (float)(q[l] & 0xF) - o0;",
           meson=["quant"]),
    Mutant("lane-window-twice",
           "each later /rerank lane also computes the last window of the lane before it (the "
           "scores stay, the forward tokens do not)",
           "*lo = (int32_t)((int64_t)l * n / n_lanes);",
           "*lo = (int32_t)((int64_t)l * n / n_lanes) - (l > 0 && n >= n_lanes);",
           pytest=["tests/test_lanes.py", "-k", "one_lanes_response"]),
    Mutant("lane-window-skipped",
           "every /rerank lane but the last skips its block's last window",
           "*hi = (int32_t)((int64_t)(l + 1) * n / n_lanes);",
           "*hi = (int32_t)((int64_t)(l + 1) * n / n_lanes) - (l + 1 < n_lanes);",
           pytest=["tests/test_lanes.py", "-k", "one_lanes_response"]),
    Mutant("lane-continues-another-lanes-rows",
           "a /rerank lane continues the prompt rows lane 0 holds instead of its own",
           "plan_group(a->ps->s, a->req, pl, first, n, &ln->held, &ln->gp, err)",
           "plan_group(a->ps->s, a->req, pl, first, n, &a->lanes[0].held, &ln->gp, err)",
           pytest=["tests/test_lanes.py", "-k", "one_lanes_response"]),
    Mutant("tokenizer-merge-off-by-one",
           "the merge loop never offers the first pair of a word",
           "for (int32_t i = a + 1; i < b; i++)", "for (int32_t i = a + 2; i < b; i++)",
           meson=["tokenizer"], pytest=["tests/test_tokenize_cli.py"]),
    Mutant("answer-late-intervention",
           "/answer's intervention starts one row after the last document",
           ".from_pos = pl->spans[pl->K - 1].end}", ".from_pos = pl->spans[pl->K - 1].end + 1}",
           pytest=["tests/test_http_answer.py"]),
    Mutant("answer-ranked-rows-dropped",
           "an /answer ranked in the batch leaves its ranking's rows out of the prompt cache, so "
           "its prompt recomputes them (forward tokens not a whole run's)",
           "(st = fitm_rerank_seq_keep_rows(q->rank, err)) == FITM_OK)",
           "true)",
           pytest=["tests/test_http_answer.py", "-k", "intervention_matches_oracle"]),
    Mutant("sample-temperature-squared",
           "the sampler divides the logits by the temperature squared",
           "p[i] = exp(((double)c[i].logit - c[0].logit) / t);",
           "p[i] = exp(((double)c[i].logit - c[0].logit) / (t * t));",
           meson=["sample"], pytest=["tests/test_sample.py"]),
    Mutant("sample-top-p-one-too-few",
           "top_p keeps the prefix whose mass stays below top_p (one candidate too few)",
           "while (n < m && mass < s->top_p * total)",
           "while (n < m && mass + p[n] < s->top_p * total)",
           meson=["sample"], pytest=["tests/test_sample.py"]),
    Mutant("sample-top-p-boundary",
           "a prefix whose mass equals top_p exactly takes one candidate more",
           "while (n < m && mass < s->top_p * total)",
           "while (n < m && mass <= s->top_p * total)",
           meson=["sample"], pytest=["tests/test_sample.py"]),
    Mutant("sample-min-p-strict",
           "min_p drops a candidate whose weight equals min_p (tied maxima at min_p 1)",
           "while (n_min < n && p[n_min] >= s->min_p)",
           "while (n_min < n && p[n_min] > s->min_p)",
           meson=["sample"], pytest=["tests/test_sample.py"]),
    Mutant("sample-top-k-ignored",
           "top_k does not cut the candidates",
           "const int32_t m = s->top_k > 0 && s->top_k < k ? s->top_k : k;",
           "const int32_t m = k;",
           meson=["sample"], pytest=["tests/test_sample.py"]),
    Mutant("cuda-reduce-no-first-barrier",
           "the block reduction writes shared memory a previous call may still be reading",
           "    __syncthreads(); /* shm may still be read by a previous call */\n", "",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-reduce-no-second-barrier",
           "the block reduction reads the warps' partial results before all are written",
           "        shm[warp] = v;\n    __syncthreads();\n    float r = lane < n_warps",
           "        shm[warp] = v;\n    float r = lane < n_warps",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-attention-span-off-by-one",
           "the attention kernel counts a span's end key as inside the span",
           "else if (j >= a.iv_spans[2 * mid + 1])", "else if (j > a.iv_spans[2 * mid + 1])",
           meson=["backend_ops_cuda_emu"]),
    Mutant("cuda-attention-tiles-v0-off-by-one",
           "the tiled attention starts a row's 128-key tiles one key after its first visible key",
           "ts[k] = fitm_att_v0(a, P0 + (warp + NW * k) / hb);",
           "ts[k] = fitm_att_v0(a, P0 + (warp + NW * k) / hb) + 1;",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-attention-tiles-sum-order",
           "the tiled attention adds a tile's four warp sums in another order: a rounding "
           "difference only, which a tolerance lets through and memcmp does not",
           "fitm_att_reduce4(fitm_warp_sum(e[0]), fitm_warp_sum(e[1]),\n"
           "                                                   fitm_warp_sum(e[2]),",
           "fitm_att_reduce4(fitm_warp_sum(e[0]), fitm_warp_sum(e[2]),\n"
           "                                                   fitm_warp_sum(e[1]),",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-attention-bf16-unanchored",
           "the tensor-core attention starts its key blocks at the tile's first visible key, "
           "not at a multiple of 64: a row's softmax then runs over blocks that depend on the "
           "rows beside it, a rounding difference only, which the row-invariance memcmp catches",
           "for (int64_t kb = fitm_att_v0(a, P0) / FITM_ATB_KEYS * FITM_ATB_KEYS; kb <= last;",
           "for (int64_t kb = fitm_att_v0(a, P0); kb <= last;",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-attention-bf16-no-rescale",
           "the tensor-core attention does not rescale a row's output when its maximum grows",
           "if (alpha != 1.0f)\n                for (int d = sq;",
           "if (false)\n                for (int d = sq;",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-warp-sum-wrong-lane",
           "the warp sum's butterfly exchanges with lane o - 1 instead of o",
           "float fitm_warp_sum(float v)\n{\n    for (int o = FITM_WARP / 2; o > 0; o >>= 1)\n"
           "        v += __shfl_xor_sync(0xffffffffu, v, o);",
           "float fitm_warp_sum(float v)\n{\n    for (int o = FITM_WARP / 2; o > 0; o >>= 1)\n"
           "        v += __shfl_xor_sync(0xffffffffu, v, o - 1);",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-qk-rope-no-barrier",
           "the fused per-head norm + RoPE rotates pairs before the other threads normed them",
           "        __syncthreads(); /* a pair's elements were normed by other threads */\n", "",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-norm-add-rmsnorm-post-weight",
           "the fused post-norm + add + norm scales the second norm by the post-norm's weight",
           "wv[j] = norm_y ? w[c] : 0.0f;",
           "wv[j] = norm_y ? w_post[c] : 0.0f;",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-matvec-stage-no-sync",
           "the matvec's lanes decode staged weight bytes before the other lanes of the warp "
           "have stored them",
           "        __syncwarp(); /* the stage is whole before any lane decodes */\n", "",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-matvec-tiles-slice-no-barrier",
           "the batched matvec's tiles stage the next slice of x while other warps still read "
           "the previous one",
           "                __syncthreads(); /* every warp is done with the previous slice */\n",
           "", meson=["cuda_kernels_emu"]),
    Mutant("cuda-matmul-glu-swapped",
           "the fused gate/up product applies the activation to the up projection",
           "gelu ? fitm_geglu1(g, u) : fitm_swiglu1(g, u)",
           "gelu ? fitm_geglu1(u, g) : fitm_swiglu1(u, g)",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-matmul-rows-n-overlap",
           "the one-launch Q/K/V product starts the third weight's blocks one block early",
           "b2 = b[0] + b[1];", "b2 = b[0] + b[1] - 1;",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-topk-threshold-one-early",
           "the top-k threshold is the (k-1)-th chunk first instead of the k-th, so the row's "
           "k-th entry may be missing from the candidates",
           "if (before == k - 1)", "if (before == k - 2)",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-kv-store-v-into-k",
           "the one-launch KV store writes each sequence's V values into its K row",
           "void *dst = blockIdx.z ? r.v_dst : r.k_dst;", "void *dst = r.k_dst;",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-tape-ignores-arguments",
           "a tape item matches work of the same kernel and configuration whatever its argument "
           "bytes, so a step whose kernel arguments changed would replay the old ones",
           "(a.arg_bytes == 0 || memcmp(bytes.data() + a.arg_at, args, a.arg_bytes) == 0)",
           "(a.arg_bytes == 0 || true)",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-tape-drops-matched-prefix",
           "at the first difference the held-back work loses the items that matched before it, "
           "so a step that falls back never runs its first kernels",
           "s->tape->append_from(*s->cands[tape_first_alive(s)], s->matched);",
           "s->tape->append_from(*s->cands[tape_first_alive(s)], 0);",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-to-bf16-truncates",
           "the tensor-core operands (weights at load, a GEMM's activations each call) are rounded "
           "to bfloat16 toward zero instead of to nearest even",
           "    return __float2bfloat16_rn(v);", "    return __float2bfloat16_rz(v);",
           meson=["cuda_kernels_emu"]),
    Mutant("cuda-gemm-bf16-reads-before-landing",
           "the GEMM's ring waits for one group fewer, so the warps multiply a stage whose "
           "asynchronous copies have not landed",
           "__pipeline_wait_prior(STAGES - 2);", "__pipeline_wait_prior(STAGES - 1);",
           meson=["cuda_kernels_emu"]),
]


def run(cmd, cwd, env=None, log=None) -> int:
    with open(log, "a") if log else open(os.devnull, "w") as out:
        return subprocess.call(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def copy_tree(dest: pathlib.Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (no build folders)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for n in filter(None, names):
        src = ROOT / os.fsdecode(n)
        if src.is_file():
            (dest / os.fsdecode(n)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(n))


def locate(tree: pathlib.Path, snippet: str) -> pathlib.Path:
    hits = [(p, p.read_text(errors="replace").count(snippet))
            for d in ("src", "kernels") for p in sorted((tree / d).rglob("*"))
            if p.is_file() and p.suffix in (".c", ".h", ".cu", ".cuh")]
    hits = [(p, n) for p, n in hits if n]
    if len(hits) != 1 or hits[0][1] != 1:
        raise SystemExit(f"snippet {snippet.splitlines()[0]!r}: found {hits or 'nowhere'}, "
                         "want exactly once under src/ and kernels/: update MUTANTS")
    return hits[0][0]


def failing_tests(tree, m: Mutant, env, log) -> list:
    """The names of m's tests that fail on the current build of tree ('build' if it failed)."""
    if run(["ninja", "-C", "build", "-j", str(os.cpu_count() or 2)], tree, env, log):
        return ["build"]
    caught = []
    for t in m.meson:
        if run(["meson", "test", "-C", "build", "--no-rebuild", t], tree, env, log):
            caught.append(f"meson:{t}")
    if m.pytest:
        junit = tree / "build" / "mutate-junit.xml"
        run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
             f"--junitxml={junit}", *m.pytest], tree, env, log)
        import xml.etree.ElementTree as ET
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    caught.append(f"{case.get('classname')}::{case.get('name')}")
            junit.unlink()
        else:
            caught.append("pytest (no report)")
    return caught


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutants to plant (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    a = ap.parse_args()
    if a.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.why}")
        return 0
    chosen = [m for m in MUTANTS if not a.names or m.name in a.names]
    if a.names and len(chosen) != len(set(a.names)):
        raise SystemExit(f"unknown mutant in {a.names}; see --list")

    tree = pathlib.Path(tempfile.mkdtemp(prefix="fitm-mutate-"))
    log = tree / "mutate.log"
    env = dict(os.environ, FITM_BUILD_DIR=str(tree / "build"))
    shared = ROOT.parent / "shared" / "data"
    if not env.get("FITM_SHARED_DATA") and shared.is_dir():
        env["FITM_SHARED_DATA"] = str(shared)
    print(f"scratch copy: {tree} (log: {log})")
    copy_tree(tree)
    if run(["meson", "setup", "build", "-Dcuda=disabled"], tree, env, log):
        raise SystemExit(f"meson setup failed: see {log}")
    status = 0
    for m in chosen:
        locate(tree, m.snippet)  # every snippet must be found before anything runs
    base = Mutant("baseline", "", "", "", sorted({t for m in chosen for t in m.meson}),
                  [])
    broken = failing_tests(tree, base, env, log)
    for m in chosen:  # the unmutated tree must pass what each mutant runs
        broken += [t for t in failing_tests(tree, Mutant("", "", "", "", [], m.pytest), env, log)
                   if t not in broken]
    if broken:
        print(f"the unmutated copy fails {broken}: mutation results would mean nothing")
        return 1
    for m in chosen:
        path = locate(tree, m.snippet)
        original = path.read_text()
        path.write_text(original.replace(m.snippet, m.replacement))
        try:
            caught = failing_tests(tree, m, env, log)
        finally:
            path.write_text(original)
        verdict = f"CAUGHT by {', '.join(caught)}" if caught else "MISSED"
        print(f"{m.name} ({path.relative_to(tree)}): {verdict}", flush=True)
        status |= not caught
    if not a.keep:
        shutil.rmtree(tree, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
