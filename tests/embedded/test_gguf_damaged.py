"""A GGUF (or a model directory) whose metadata lies can neither crash nor exhaust the loader: every damaged file of
``damaged_gguf.DAMAGES`` (zero, negative and out-of-range values, wrong types, shapes and layer counts that
disagree with the tensors, a feed-forward length of 2**36), a truncated file and model directories whose
config.json claims what their weights do not hold, through ``dspine-batch generate --model BAD``: one line naming
the file and the key or tensor, exit 2, no traceback, and the process's peak memory under 500 MB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from damaged_gguf import DAMAGES, write
from helpers import subprocess_env

from dspine import load_target
from dspine.embedded.gguf_convert import convert_gguf

pytest.importorskip("gguf")

# model directories converted from the undamaged llama file, then config.json edited: key -> (value, named)
DIR_DAMAGES = {"dir_wide_mlp": ("intermediate_size", 2**36, "mlp"), "dir_many_layers": ("num_hidden_layers", 2**21,
               "num_hidden_layers"), "dir_no_heads": ("num_attention_heads", 0, "num_attention_heads")}

# Each damaged path through the real CLI's ``main`` (the console script's entry point), all in one interpreter
# (one start-up instead of 30): its exit code and stderr per path, and the process's peak RSS over all of them. A
# watchdog ends the process once its RSS passes 1 GB, naming the path that took it (a loader that sizes things by
# the metadata would otherwise run out of memory, slowly).
RUNNER = r"""
import contextlib, io, json, os, resource, sys, threading, time
from dspine_batch.cli import main

def peak_mb():
    # this process's high-water mark: VmHWM (getrusage's ru_maxrss keeps the forking parent's across exec)
    try:
        status = open("/proc/self/status").read()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def watch():
    while peak_mb() < 1024:
        time.sleep(0.05)
    sys.__stdout__.write(json.dumps({"results": results, "peak_mb": peak_mb(), "blew_up": model}) + "\n")
    sys.__stdout__.flush()
    os._exit(0)

results, model = {}, None
threading.Thread(target=watch, daemon=True).start()
for model in sys.argv[3:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["generate", "--engine", "reference", "--model", model, "--draft", "none", sys.argv[1], "-o",
                  sys.argv[2] + "/" + model.rsplit("/", 1)[-1]])
            code = 0
        except SystemExit as e:
            code = e.code
    results[model] = [code, err.getvalue()]
print(json.dumps({"results": results, "peak_mb": peak_mb(), "blew_up": None}))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (the damaged path, what its error must name)."""
    root = tmp_path_factory.mktemp("damaged")
    out = {name: (write(root / f"{name}.gguf", arch, meta, tensors), named)
           for name, (arch, meta, tensors, named) in DAMAGES.items()}
    whole = write(root / "whole.gguf", "llama").read_bytes()
    (root / "truncated.gguf").write_bytes(whole[: len(whole) * 2 // 3])
    out["truncated"] = (root / "truncated.gguf", "not a readable GGUF")
    for name, (key, value, named) in DIR_DAMAGES.items():
        convert_gguf(root / "whole.gguf", root / name)
        cfg = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**cfg, key: value}))
        out[name] = (root / name, named)
    return out


@pytest.fixture(scope="module")
def through_the_cli(corpus, tmp_path_factory) -> dict:
    from dspine.cpu.disk_cache import cache_root

    root = tmp_path_factory.mktemp("cli")
    (root / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (root / "cache").mkdir()  # conversions in a cache of its own; the CPU kernels this machine built, not again
    (cache_root() / "kernels").mkdir(parents=True, exist_ok=True)
    (root / "cache" / "kernels").symlink_to(cache_root() / "kernels", target_is_directory=True)
    paths = [str(p) for p, _ in corpus.values()]
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(root / "in.jsonl"), str(root / "out"), *paths],
                          env=subprocess_env(DSPINE_CACHE_DIR=str(root / "cache")), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_the_undamaged_files_convert_and_load(tmp_path, arch):
    """The corpus's files before damage are good models: what fails below fails for its damage."""
    convert_gguf(write(tmp_path / "ok.gguf", arch), tmp_path / "ok")
    assert load_target(tmp_path / "ok").family == arch


@pytest.mark.parametrize("name", [*DAMAGES, "truncated", *DIR_DAMAGES])
def test_a_damaged_model_is_one_line_and_exit_2(name, corpus, through_the_cli):
    path, named = corpus[name]
    assert str(path) in through_the_cli["results"], f"not reached: {through_the_cli['blew_up']} took over 1 GB"
    code, err = through_the_cli["results"][str(path)]
    lines = [ln for ln in err.splitlines() if ln.startswith("dspine-batch: error:")]
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err and str(path) in lines[0] and named in lines[0], err


def test_the_damaged_models_never_take_memory(through_the_cli):
    """Every path above in one process (a 2**36-wide MLP, a vocabulary of 2**36, 2**21 layers among them): its
    peak RSS stays that of the start-up (torch imported: ~300 MB), nothing sized by the metadata is allocated."""
    assert through_the_cli["blew_up"] is None and through_the_cli["peak_mb"] < 500, through_the_cli
