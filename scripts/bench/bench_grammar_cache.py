"""The first structured request's grammar set-up, cold (empty per-machine cache) vs warm (issue 44, item 4).

  python scripts/bench/bench_grammar_cache.py [--repeats 3]

Each measurement is a fresh process: ``import xgrammar`` (not timed), then ``Grammars.for_hf_dir`` on the embedded
model's tokenizer and one JSON schema compiled, timed in CPU and wall seconds; a new cache folder per repeat,
cold first, then warm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_line, load_line  # noqa: E402

CODE = r'''
import json, time
import xgrammar  # noqa: F401  (not timed: every structured job imports it)
from dspine.decoding.grammar import Grammars
from dspine.embedded.smollm2 import embedded_target_path
from tokenizers import Tokenizer
p = str(embedded_target_path())
tok = Tokenizer.from_file(p + "/tokenizer.json")
c, w = time.process_time(), time.time()
g = Grammars.for_hf_dir(p, 49152, [2], lambda s: tok.encode(s, add_special_tokens=False).ids)
g.get("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                 "age": {"type": "integer"}}, "required": ["name", "age"]}))
print(json.dumps({"cpu_s": time.process_time() - c, "wall_s": time.time() - w}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"# {cpu_line()}; {load_line()}")
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "DSPINE_CACHE_DIR": d}
            if "DSPINE_CACHE_DIR" in os.environ or os.path.isdir(os.path.expanduser("~/.cache/dspine")):
                # the converted embedded model lives in the real cache: point at it, keep grammar/ fresh
                real = os.environ.get("DSPINE_CACHE_DIR", os.path.expanduser("~/.cache/dspine"))
                for name in os.listdir(real):
                    if name.startswith("smollm2"):
                        os.symlink(os.path.join(real, name), os.path.join(d, name))
            for which in ("cold", "warm"):
                out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(out.stderr[-2000:])
                m = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"repeat {r + 1} {which}: {m['cpu_s']:.3f} s CPU, {m['wall_s']:.3f} s wall", flush=True)
    print(f"# after: {load_line()}")


if __name__ == "__main__":
    main()
