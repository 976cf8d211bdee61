"""Checks that every #include between src/ folders points down the layer order of
src/meson.build: a folder includes itself or a layer listed before it, never after it.
server/ and cli/ are peers at the top and include neither each other.

Usage: python3 src/check_layers.py SRC_DIR   (exit status 1 with one line per bad include)
"""
import pathlib
import re
import sys

ORDER = ["base", "gguf", "compute", "tokenizer", "model", "pipeline", "server", "cli"]
RANK = {"base": 0, "gguf": 1, "compute": 2, "tokenizer": 3, "model": 4, "pipeline": 5,
        "server": 6, "cli": 6}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def bad_includes(src):
    for path in sorted(src.rglob("*")):
        if path.suffix not in (".c", ".h") or path.parent == src:
            continue
        layer = path.parent.name
        for target in INCLUDE.findall(path.read_text(encoding="utf-8")):
            if "/" not in target:
                # fitm_config.h: generated; kernels.h: the CUDA kernels' C ABI (kernels/,
                # which itself includes only base/), for model/backend_cuda.c
                if not (path.parent / target).exists() and target not in ("fitm_config.h",
                                                                          "kernels.h"):
                    yield f"{path}: \"{target}\" is not under its folder's path"
                continue
            dest = target.split("/")[0]
            if dest not in RANK:
                yield f"{path}: \"{target}\" names no layer"
            elif dest != layer and RANK[dest] >= RANK[layer]:
                yield f"{path}: {layer}/ includes {target} (upward or sideways)"


def main():
    src = pathlib.Path(sys.argv[1])
    missing = [d for d in ORDER if not (src / d).is_dir()]
    found = list(bad_includes(src)) + [f"{src}/{d}: layer folder missing" for d in missing]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
