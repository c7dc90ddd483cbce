"""The DSPINE SGLang plugin against the real sglang==0.5.23 on CPU (run in the sglang venv:
``scripts/ci/ci_sglang.sh``; skipped where ``import sglang`` fails).

Covers what a CPU can show: the entry point loads in a fresh interpreter and registers the algorithm and the
model; every flag of the seed command resolves with ``device="cpu"``; wrong checkpoints / block sizes fail
clearly at resolution; ``SGLANG_PLUGINS`` without ``dspine`` is detected; SGLang parses our draft config as a
*causal* DFlash-family draft; the ReplaySSM step indices equal SGLang's own; the recorded meta_info fixture is
what 0.5.23 produces. The worker's GPU path is checked by the commands in the closing note of issue 5.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang", reason="needs the sglang extra (scripts/setup_sglang_venv.sh)")

import torch  # noqa: E402

from dspine.sglang import draft_math as dm  # noqa: E402
from dspine.sglang import plugin  # noqa: E402
from dspine.sglang.config import DSpineConfigError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SEED = """sglang serve --model-path Qwen/Qwen3.8-27B --speculative-algorithm DSPINE \
  --speculative-draft-model-path /path/to/Qwen3.8-27B-DSpine-b16 --speculative-num-draft-tokens 16 \
  --dtype bfloat16 --attention-backend fa3 --speculative-draft-attention-backend fa3 \
  --linear-attn-backend triton --enable-linear-replayssm-spec --mamba-ssm-dtype float32 \
  --mamba-radix-cache-strategy extra_buffer --max-mamba-cache-size 64 --mem-fraction-static 0.80 \
  --context-length 131072 --max-running-requests 8 --cuda-graph-max-bs-decode 8 --min-free-slots-delay 1 \
  --sampling-backend flashinfer --reasoning-parser qwen3 --tool-call-parser qwen3_coder --trust-remote-code"""
SEED_FIELDS = {
    "model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_draft_tokens", "dtype",
    "attention_backend", "speculative_draft_attention_backend", "linear_attn_backend",
    "enable_linear_replayssm_spec", "mamba_ssm_dtype", "mamba_radix_cache_strategy", "max_mamba_cache_size",
    "mem_fraction_static", "context_length", "max_running_requests", "cuda_graph_max_bs_decode",
    "min_free_slots_delay", "sampling_backend", "reasoning_parser", "tool_call_parser", "trust_remote_code",
}


def _run(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=REPO,
                          timeout=timeout)


# -- fixtures: a tiny Qwen3.5-style hybrid target and a tiny DSpine draft made by dspine's init_draft ------------


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import save_tiny_qwen35

    from dspine import load_target
    from dspine.draft.io import init_draft

    root = tmp_path_factory.mktemp("sglang_tiny")
    tdir = save_tiny_qwen35(root / "target", max_position_embeddings=262144)
    target = load_target(tdir)
    draft = init_draft(target, num_layers=2, block_size=16, transfer_rank=8, message_size=16, top_k=4,
                       intermediate_size=64)
    draft.save(root / "draft")
    return SimpleNamespace(root=root, target=Path(tdir), draft=root / "draft", target_model=target)


@pytest.fixture(autouse=True)
def _registered():
    plugin.register()
    yield


@pytest.fixture(autouse=True)
def extra_buffer_platform(monkeypatch):
    """SGLang's own CUDA-only predicate for mamba extra_buffer (docs/design.md, "The SGLang plugin") stands in for a GPU
    (the hybrid target makes SGLang pick extra_buffer even by default)."""
    import sglang.srt.arg_groups.mamba_hook as mh

    monkeypatch.setattr(mh, "_platform_supports_mamba_cache_extra_buffer", lambda *a, **k: True)


def _seed_flags(tiny, **over):
    from dspine_batch.engines.sglang.engine import parse_server_flags

    flags = parse_server_flags(shlex.split(SEED))
    assert set(flags) == SEED_FIELDS  # every flag of the seed command, parsed by SGLang's own parser
    flags.update(model_path=str(tiny.target), speculative_draft_model_path=str(tiny.draft))
    flags.update(over)
    return flags


def _resolve(**flags):
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(**flags, device="cpu")
    sa.resolve_once()
    return sa, sa.resolved_dict()


# -- 1. entry point ------------------------------------------------------------------------------------------------


def test_entry_point_registers_algorithm_and_model_in_a_fresh_interpreter():
    r = _run("""
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
assert 'sglang.srt.models.registry' not in sys.modules, 'plugin must not import every model'
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S
a = S.from_string('DSPINE')
print('ALGO', type(a).__name__, a.is_dflash_family(), a.supports_target_verify_for_draft(), a.is_dflash())
from sglang.srt.models.registry import ModelRegistry
print('MODEL', ModelRegistry.models['DSpineDraftModel'].__module__)
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ALGO DSpineAlgo True True False" in r.stdout
    assert "MODEL dspine.sglang.models.dspine_draft" in r.stdout


def test_sglang_plugins_without_dspine_is_detected_and_reported():
    r = _run("""
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S
try:
    S.from_string('DSPINE'); print('RESOLVED')
except ValueError as e:
    print('SGLANG SAYS', e)
from dspine.sglang.plugin import ensure_available
try:
    ensure_available(); print('NO PROBLEM')
except RuntimeError as e:
    print('WE SAY', e)
""", env={"SGLANG_PLUGINS": "smg-zmq"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SGLANG SAYS Unknown speculative algorithm name: DSPINE" in r.stdout
    assert "WE SAY DSPINE cannot run in SGLang: SGLANG_PLUGINS='smg-zmq' does not include 'dspine'" in r.stdout
    assert plugin.plugins_env_problem({"SGLANG_PLUGINS": "a, dspine"}) is None
    assert plugin.plugins_env_problem({}) is None
    assert "add it" in plugin.plugins_env_problem({"SGLANG_PLUGINS": "a"})


def test_register_is_idempotent_and_explicitly_callable():
    from dspine.sglang.algo import register_algorithm

    plugin.register()
    plugin.register()
    assert register_algorithm() is False  # already there: no duplicate-registration error
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    assert repr(SpeculativeAlgorithm.from_string("dspine")) == "DSpineAlgo('DSPINE')"
    assert plugin.problems() == []


def test_algo_has_every_method_the_scheduler_calls_on_an_algorithm():
    """0.5.23 checks only is_*/supports_* on plugin classes; the scheduler also calls create_future_map,
    carries_draft_hidden_states and need_topk, which the base CustomSpecAlgo lacks."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from dspine.sglang.algo import DSpineAlgo

    public = {n for n, v in vars(SpeculativeAlgorithm).items() if callable(v) and not n.startswith("_")}
    public -= {"from_string", "register"}
    assert not public - set(dir(DSpineAlgo)), public - set(dir(DSpineAlgo))
    assert {"create_future_map", "carries_draft_hidden_states", "need_topk"} - set(dir(CustomSpecAlgo))
    algo = SpeculativeAlgorithm.from_string("DSPINE")
    assert algo.carries_draft_hidden_states() is False and algo.need_topk() is False
    assert algo.supports_ragged_verify() is False and algo.has_draft_kv() is True


# -- 2. the seed command resolves -------------------------------------------------------------------------------


def test_seed_flags_resolve_with_dspine_on_cpu(tiny, extra_buffer_platform):
    sa, d = _resolve(**_seed_flags(tiny))
    assert d["speculative_algorithm"] == "DSPINE"
    assert (d["speculative_num_steps"], d["speculative_eagle_topk"], d["speculative_num_draft_tokens"]) == (1, 1, 16)
    assert d["max_running_requests"] == 8 and d["enable_linear_replayssm_spec"] is True
    assert d["mamba_ssm_dtype"] == "float32" and d["mamba_radix_cache_strategy"] == "extra_buffer"
    assert d["speculative_draft_attention_backend"] == "fa3" and d["context_length"] == 131072
    sources = [s for s, _ in sa._resolved_overrides]
    assert "handle_speculative_decoding.custom_algo" in sources  # our handler ran through SGLang's recorder


def test_defaults_come_from_the_draft(tiny):
    _, d = _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                    speculative_draft_model_path=str(tiny.draft))
    assert d["speculative_num_draft_tokens"] == 16 and d["max_running_requests"] == 48
    _, d = _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                    speculative_draft_model_path=str(tiny.draft), speculative_num_draft_tokens=8)
    assert d["speculative_num_draft_tokens"] == 8  # fewer drafts than trained: exact for a causal block


def test_unregistered_name_and_dflash_on_cpu_fail_as_sglang_says(tiny):
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="Unknown speculative algorithm name: DSPINX"):
        ServerArgs(model_path=str(tiny.target), speculative_algorithm="DSPINX", device="cpu").resolve_once()


# -- 3. clear errors -----------------------------------------------------------------------------------------------


def _copy_draft(tiny, tmp_path, edit=None):
    dst = tmp_path / "draft"
    shutil.copytree(tiny.draft, dst)
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("num, match", [
    (17, r"--speculative-num-draft-tokens 17 does not fit the draft's block_size 16: the value counts the anchor"),
    (1, "does not fit"),
])
def test_wrong_block_size_is_a_clear_error(tiny, num, match):
    with pytest.raises(ValueError, match=match):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                 speculative_draft_model_path=str(tiny.draft), speculative_num_draft_tokens=num)


def test_block_size_flags_must_agree(tiny):
    with pytest.raises(ValueError, match="--speculative-dflash-block-size 8 differ"):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                 speculative_draft_model_path=str(tiny.draft), speculative_num_draft_tokens=16,
                 speculative_dflash_block_size=8)


def _dflash_style(cfg):
    cfg["architectures"] = ["DFlashDraftModel"]
    del cfg["dspine_config"]


def _other_target(cfg):
    cfg["hidden_size"] = 128


def _bad_rank(cfg):
    cfg["dspine_config"]["transfer_rank"] = 10**6


@pytest.mark.parametrize("edit, match", [
    (_dflash_style, "looks like a DFlash draft: use --speculative-algorithm DFLASH"),
    (_other_target, "hidden_size"),
    (_bad_rank, "dspine_config.transfer_rank"),
])
def test_wrong_draft_checkpoint_is_a_clear_error(tiny, tmp_path, edit, match):
    bad = _copy_draft(tiny, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE", speculative_draft_model_path=str(bad))


def test_missing_or_unready_draft_is_a_clear_error(tiny, tmp_path):
    from dspine.sglang.config import read_draft

    # SGLang itself reads the draft config before any plugin hook (a hub-id error for a missing dir) ...
    with pytest.raises((OSError, ValueError)):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                 speculative_draft_model_path=str(tmp_path / "nope"))
    # ... so the adapter checks it first with ours
    with pytest.raises(ValueError, match="not a local directory"):
        read_draft(tmp_path / "nope")
    from safetensors.torch import load_file, save_file

    bad = _copy_draft(tiny, tmp_path)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["transfer_ready"] = torch.tensor(False)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="transfer_ready is false"):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE", speculative_draft_model_path=str(bad))


@pytest.mark.parametrize("over, match", [
    ({"speculative_eagle_topk": 4}, "one linear chain"),
    ({"tp_size": 2}, "one GPU per replica"),
    ({"speculative_accept_threshold_single": 0.5}, "lossy"),
])
def test_unsupported_settings_are_refused(tiny, over, match):
    with pytest.raises(ValueError, match=match):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                 speculative_draft_model_path=str(tiny.draft), **over)


def test_config_error_type():
    assert issubclass(DSpineConfigError, ValueError)


# -- 4. SGLang reads our draft as a causal DFlash-family draft ----------------------------------------------------


def test_sglang_parses_the_draft_config_as_a_causal_block(tiny):
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.models.dflash import _get_dflash_layer_attention_params
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    from dspine.draft.config import parse_draft_config

    cfg = get_config(str(tiny.draft), trust_remote_code=False)
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    draft_cfg = json.loads((tiny.draft / "config.json").read_text())
    assert parsed.resolve_block_size(default=None) == 16
    assert parsed.mask_token_id == draft_cfg["dflash_config"]["mask_token_id"]
    assert list(parsed.target_layer_ids) == draft_cfg["dflash_config"]["target_layer_ids"]
    for i in range(cfg.num_hidden_layers):
        _, kind = _get_dflash_layer_attention_params(cfg, i)
        assert kind == AttentionType.DECODER  # causal in-block attention (DFlash's own drafts: ENCODER_ONLY)
    spec = parse_draft_config(cfg.to_dict())  # what DSpineDraftModel.__init__ validates
    assert spec.block_size == 16 and spec.transfer_rank == 8


def test_replayssm_step_indices_equal_sglangs_own(monkeypatch):
    import sglang.srt.speculative.spec_utils as su

    monkeypatch.setattr(su, "mamba_track_grid", lambda page: 256)
    seq_pre = torch.tensor([10, 254, 255, 500, 1023])
    commit = torch.tensor([1, 4, 2, 16, 3], dtype=torch.int32)
    B = 16
    batch = SimpleNamespace(seq_lens=seq_pre, mamba_track_indices=torch.zeros(5, dtype=torch.int64),
                            tree_cache=SimpleNamespace(page_size=1))
    theirs = su._verify_commit_step_indices(batch=batch, accept_index=dm.chain_accept_index(commit, B),
                                            accept_lens=commit, draft_token_num=B)
    ours = dm.replayssm_step_indices(seq_pre, commit, 256)
    assert torch.equal(ours[0], theirs[0].to(torch.int64)) and torch.equal(ours[1], theirs[1].to(torch.int64))
    batch.mamba_track_indices = None
    theirs = su._verify_commit_step_indices(batch=batch, accept_index=dm.chain_accept_index(commit, B),
                                            accept_lens=commit, draft_token_num=B)
    assert torch.equal(dm.replayssm_step_indices(seq_pre, commit, None)[0], theirs[0].to(torch.int64))


# -- 5. meta_info and the adapter with the real parser ---------------------------------------------------------


def test_recorded_meta_info_fixture_is_what_sglang_0_5_23_produces():
    from sglang_meta_recorder import record_all

    recorded = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_0_5_23_meta_info.json").read_text())
    assert record_all() == recorded


def test_engine_kwargs_from_the_seed_command_and_engine_args(tiny):
    from sglang.srt.server_args import ServerArgs

    from dspine_batch.engines.sglang.engine import build_server_kwargs

    flags = SEED.split(" ", 2)[2]
    kw, _ = build_server_kwargs(str(tiny.target), str(tiny.draft),
                                {"server_flags": flags, "mem-fraction-static": "0.7", "enable_metrics": "true"})
    assert kw["model_path"] == str(tiny.target)  # --model/--draft win over the pasted command's paths
    assert kw["speculative_draft_model_path"] == str(tiny.draft) and kw["speculative_algorithm"] == "DSPINE"
    assert kw["mem_fraction_static"] == 0.7 and kw["enable_metrics"] is True
    assert kw["enable_linear_replayssm_spec"] is True and kw["speculative_num_draft_tokens"] == 16
    kw.update(model_path=str(tiny.target), speculative_draft_model_path=str(tiny.draft), device="cpu")
    ServerArgs(**kw)  # every key is a real ServerArgs field (unknown ones raise TypeError)


# -- 6. the draft model's strict loader (on a CPU shell with SGLang's parameter layout) ---------------------------


def _shell_model(tiny, draft_dir=None):
    """A DSpineDraftModel without SGLang's runtime context: SGLang's DFlash parameter names (fused qkv_proj /
    gate_up_proj with shard loaders, the rest as in the checkpoint), our injection and buffers."""
    from safetensors import safe_open
    from torch import nn

    from dspine.draft.config import parse_draft_config
    from dspine.draft.model import Injection
    from dspine.sglang.models.dspine_draft import DSpineDraftModel

    draft_dir = draft_dir or tiny.draft
    cfg = json.loads((draft_dir / "config.json").read_text())
    spec = parse_draft_config(cfg)
    m = DSpineDraftModel.__new__(DSpineDraftModel)
    nn.Module.__init__(m)
    shards: dict[str, list] = {}

    def put(path: str, param):
        mod = m
        *parents, leaf = path.split(".")
        for name in parents:
            if not hasattr(mod, name):
                mod.add_module(name, nn.Module())
            mod = getattr(mod, name)
        mod.register_parameter(leaf, param)

    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    for n in names:
        if n.startswith(("injection.", "confidence_head.", "transfer_", "draft_vocab")):
            continue
        for part, fused in (("q_proj", "qkv_proj"), ("k_proj", None), ("v_proj", None),
                            ("gate_proj", "gate_up_proj"), ("up_proj", None)):
            if f".{part}." in n:
                if fused:
                    key = n.replace(part, fused)
                    p = nn.Parameter(torch.zeros(1), requires_grad=False)
                    p.weight_loader = lambda param, w, shard, key=key: shards.setdefault(key, []).append(shard)
                    put(key, p)
                break
        else:
            put(n, nn.Parameter(torch.zeros(shapes[n]), requires_grad=False))
    m.injection = Injection(spec.hidden_size, spec.transfer_rank, spec.message_size, spec.num_layers)
    m.register_buffer("transfer_codes", torch.zeros(spec.vocab_size, spec.transfer_rank))
    m.register_buffer("transfer_ready", torch.tensor(False))
    if spec.draft_vocab_size is not None:
        m.register_buffer("draft_vocab", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
    else:
        m.draft_vocab = None
    m._head_rows = m._pad_ids = None
    m.spec = spec
    m._expected = DSpineDraftModel._expected_names(cfg)
    return m, shards


def _weights(tiny, drop=None, add=None, edit=None):
    from safetensors.torch import load_file

    w = load_file(str(tiny.draft / "model.safetensors"))
    if drop:
        w.pop(drop)
    if add:
        w[add] = torch.zeros(1)
    if edit:
        edit(w)
    return [(f"model.{k}", v) for k, v in w.items()]  # the optional prefix


def test_draft_loader_is_strict(tiny):
    from safetensors.torch import load_file

    m, shards = _shell_model(tiny)
    m.load_weights(_weights(tiny))
    ref = load_file(str(tiny.draft / "model.safetensors"))
    assert bool(m.transfer_ready) and torch.equal(m.transfer_codes, ref["transfer_codes"])
    assert torch.equal(m.injection.writes[1].weight, ref["injection.writes.1.weight"])
    assert torch.equal(m.fc.weight, ref["fc.weight"])
    assert sorted(shards["layers.0.self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    assert sorted(shards["layers.1.mlp.gate_up_proj.weight"]) == [0, 1]
    m, _ = _shell_model(tiny)
    with pytest.raises(ValueError, match=r"missing \['injection.bias'\]"):
        m.load_weights(_weights(tiny, drop="injection.bias"))
    m, _ = _shell_model(tiny)
    with pytest.raises(ValueError, match="unexpected \\['model.mystery.weight'\\]"):
        m.load_weights(_weights(tiny, add="mystery.weight"))
    m, _ = _shell_model(tiny)
    with pytest.raises(ValueError, match="transfer_ready is false"):
        m.load_weights(_weights(tiny, edit=lambda w: w.__setitem__("transfer_ready", torch.tensor(False))))
    m, _ = _shell_model(tiny)
    m.load_weights(_weights(tiny, add="lm_head.weight"))  # borrowed from the target: ignored


def test_draft_vocab_is_loaded_and_used_for_candidates(tiny, tmp_path):
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from dspine.draft.io import load_draft, with_draft_vocab

    vocab = torch.arange(0, 256, 5)
    with_draft_vocab(load_draft(tiny.draft), vocab).save(tmp_path / "d")
    m, _ = _shell_model(tiny, tmp_path / "d")
    m.load_weights(list(load_file(str(tmp_path / "d" / "model.safetensors")).items()))
    assert torch.equal(m.draft_vocab, vocab)
    head = torch.randn(256, m.spec.hidden_size)
    m.lm_head = SimpleNamespace(weight=head)
    m.hidden_size = m.spec.hidden_size
    m.candidate_selector = SimpleNamespace(top_k=4)
    m.prepare_vocab()  # at load (the worker's __init__): the padding ids need a host read, never in a round
    assert m._pad_ids is not None and torch.equal(m._head_rows[1], head[vocab])
    import dspine.sglang.draft_math as dm

    def no_host_read(*a, **k):
        raise AssertionError("the draft-vocabulary caches were built inside a round")

    real, dm.pad_candidate_ids = dm.pad_candidate_ids, no_host_read
    try:
        hidden = torch.randn(6, m.spec.hidden_size * 2 + m.spec.transfer_rank)
        ids, vals = m.compute_candidates(hidden)
        m.lm_head = SimpleNamespace(weight=head.clone())  # a replaced head: its rows again, without a host read
        ids2, _ = m.compute_candidates(hidden)
    finally:
        dm.pad_candidate_ids = real
    best = (hidden[:, : m.hidden_size] @ head.T)[:, vocab].topk(4, dim=-1)
    assert torch.equal(ids, vocab[best.indices]) and torch.allclose(vals, best.values) and torch.equal(ids, ids2)


# -- 7. the worker's seams in SGLang 0.5.23 (it cannot run without CUDA; its contract with DFlash can be checked) --


def test_worker_overrides_match_dflash_seams():
    import inspect

    from sglang.srt.speculative import base_spec_worker, spec_utils
    from sglang.srt.speculative import dflash_worker_v2 as dw

    from dspine.sglang.models.dspine_draft import DSpineSelector
    from dspine.sglang.worker import DSpineWorkerV2, gdn_replayssm_active

    base = dw.DFlashWorkerV2
    for name in ("_update_target_mamba_state_after_verify", "__init__", "init_attention_backends"):
        assert inspect.signature(getattr(DSpineWorkerV2, name)).parameters.keys() == \
            inspect.signature(getattr(base, name)).parameters.keys(), name
    assert inspect.signature(DSpineWorkerV2.on_verify_complete_cpu).parameters.keys() == \
        inspect.signature(base_spec_worker.BaseSpecWorker.on_verify_complete_cpu).parameters.keys()
    assert "prepared_step_indices" in inspect.signature(spec_utils.commit_mamba_states_after_verify).parameters
    # the selector seam DFlash drives (_selector_lattice / _SelectorDraftSampler / _propose_selector_block)
    src = inspect.getsource(dw)
    assert "draft_model.compute_candidates(" in src and "candidate_selector.build_lattice(" in src
    assert "self.selector.sample_path(" in src
    # the pre-verify seam: after both proposal paths, the block is read first by these two calls
    fwd = inspect.getsource(base.forward_batch_generation)
    copy, tree, verify = (fwd.index("draft_tokens[:, 1:].copy_(draft_next)"),
                          fwd.index("GrammarTree.from_linear_chain(draft_tokens)"),
                          fwd.rindex("verify_input = DFlashVerifyInput("))
    assert copy < tree < verify and "_selector_sample = (" in fwd[:copy]
    assert "on_verify_complete_cpu(" in inspect.getsource(
        __import__("sglang.srt.managers.scheduler_components.batch_result_processor", fromlist=["x"]))
    for method, kws in (("build_lattice", {"candidate_ids", "unary_logits", "hidden_states", "anchor_token_ids"}),
                        ("sample_path", {"candidate_ids", "scores", "uniforms", "temperatures", "greedy_mask"})):
        assert set(inspect.signature(getattr(DSpineSelector, method)).parameters) - {"self"} == kws
    pool = SimpleNamespace
    assert gdn_replayssm_active(pool(mamba_pool=pool(replayssm_spec_fold=True, replayssm_is_kda=False)))
    assert gdn_replayssm_active(pool(mamba_pool=pool(replayssm_cache_base=torch.zeros(1))))
    assert not gdn_replayssm_active(pool(mamba_pool=pool(replayssm_spec_fold=True, replayssm_is_kda=True)))
    assert not gdn_replayssm_active(pool(mamba_pool=None))


def test_worker_refuses_other_devices():
    from dspine.sglang.worker import DSpineWorkerV2

    with pytest.raises(RuntimeError, match="not on 'npu'"):
        DSpineWorkerV2(None, 0, 0, SimpleNamespace(device="npu"))


def test_worker_refuses_a_hybrid_target_on_the_cpu_without_replayssm():
    """Asked once the target's pools exist (SGLang builds the speculative worker before them)."""
    from dspine.sglang.worker import DSpineWorkerV2, cpu_hybrid_problem

    pool = SimpleNamespace
    no_ring = pool(mamba_pool=pool(replayssm_cache_base=None, replayssm_spec_fold=False))
    worker = object.__new__(DSpineWorkerV2)
    worker.device, worker.model_runner = "cpu", SimpleNamespace(req_to_token_pool=no_ring)
    with pytest.raises(RuntimeError, match="on the CPU needs --enable-linear-replayssm-spec"):
        worker.init_attention_backends()
    assert cpu_hybrid_problem("cuda:0", no_ring) is None  # the GPU commits through the recurrent verify too
    assert cpu_hybrid_problem("cpu", pool(mamba_pool=None)) is None  # a dense target
    assert cpu_hybrid_problem("cpu", pool(mamba_pool=pool(replayssm_cache_base=torch.zeros(1)))) is None


def test_extra_buffer_is_refused_on_the_cpu_and_auto_picks_no_buffer(tiny, monkeypatch):
    """SGLang keeps Mamba prefix-cache state snapshots on GPUs only: on the CPU its own platform check refuses
    extra_buffer; with the CPU path's defaults (overlap off) its auto strategy picks no_buffer."""
    if torch.cuda.is_available():
        pytest.skip("a GPU supports extra_buffer")
    monkeypatch.undo()  # SGLang's real platform predicate
    with pytest.raises(AssertionError, match="extra_buffer requires platform support for Mamba cache state"):
        _resolve(**_seed_flags(tiny))
    _, d = _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                    speculative_draft_model_path=str(tiny.draft), enable_linear_replayssm_spec=True,
                    disable_overlap_schedule=True)
    assert d["mamba_radix_cache_strategy"] == "no_buffer" and d["mamba_ssm_dtype"] == "float32"


# -- 5. SGLang's name checks, the draft backend, shipped jobs ----------------------------------------------------


@pytest.mark.parametrize("over, match", [
    ({"speculative_use_block_verification": True}, "block-verification(: not supported with DSPINE| only supports)"),
    ({"enable_lora": True}, "lora.*not supported with DSPINE"),
    ({"speculative_draft_attention_backend": "flex_attention"}, "not one the DSPINE draft can use"),
])
def test_features_sglang_gates_by_name_are_refused_clearly(tiny, over, match):
    with pytest.raises(ValueError, match=match):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                 speculative_draft_model_path=str(tiny.draft), **over)


def test_ragged_verify_mode_is_refused(tiny, monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "dynamic")
    with pytest.raises(ValueError, match="fixed-width block"):
        _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                 speculative_draft_model_path=str(tiny.draft))


def test_draft_attention_backend_follows_the_target_like_dflash(tiny):
    _, d = _resolve(model_path=str(tiny.target), speculative_algorithm="DSPINE",
                    speculative_draft_model_path=str(tiny.draft), attention_backend="torch_native")
    assert d["speculative_draft_attention_backend"] == "torch_native"


def test_window_size_warning_is_not_given_for_dspine():
    import logging

    from dspine.sglang.name_checks import SPECULATIVE_HOOK_LOGGER, FalseWindowWarning

    log = logging.getLogger(SPECULATIVE_HOOK_LOGGER)
    assert any(isinstance(f, FalseWindowWarning) for f in log.filters)
    rec = logging.LogRecord(SPECULATIVE_HOOK_LOGGER, logging.WARNING, "", 0,
                            "--speculative-draft-window-size has no effect with speculative_algorithm=%s (...)",
                            ("DSPINE",), None)
    assert not log.filters[-1].filter(rec)
    rec.args = ("NGRAM",)
    assert FalseWindowWarning().filter(rec)


def test_dspine_is_in_sglangs_speculative_metrics_snapshot():
    import sglang.srt.managers.scheduler_components.metrics_reporter as mr
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    assert SpeculativeAlgorithm.from_string("DSPINE") in mr._SPEC_DECODE_SNAPSHOT_ALGORITHMS


def _shipped_engine_args():
    import re
    import tomllib

    jobs = {p.name: tomllib.loads(p.read_text()) for p in sorted((REPO / "jobs").glob("*.toml"))}
    doc = (REPO / "docs" / "slurm.md").read_text()
    for i, block in enumerate(re.findall(r"```toml\n(.*?)```", doc, re.S)):
        jobs[f"docs/slurm.md#{i}"] = tomllib.loads(block)
    return {k: v for k, v in jobs.items() if v.get("engine") == "sglang"}


def test_shipped_sglang_jobs_and_docs_resolve_with_dspine(tiny):
    from dspine_batch.engines.sglang.args import build_server_kwargs

    jobs = _shipped_engine_args()
    assert "nightly-synth.toml" in jobs and any(k.startswith("docs/") for k in jobs)
    for name, job in jobs.items():
        kwargs, _ = build_server_kwargs(str(tiny.target), str(tiny.draft), dict(job.get("engine_args") or {}))
        kwargs.pop("custom_sigquit_handler")
        _resolve(**kwargs)  # raises (DSpineConfigError) for tp_size 8 and the like
        assert int((job.get("slurm") or {}).get("gpus_per_task", 1)) == 1, name
    template = (REPO / "scripts" / "slurm" / "gpu-sglang.sbatch").read_text()
    assert "tp_size=8" not in template and "tp_size = 8" not in template


# -- 6. the CPU bridges -------------------------------------------------------------------------------------------


def test_cpu_bridges_are_in_place_without_a_gpu():
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

    from dspine.sglang import cpu

    if torch.cuda.is_available():
        pytest.skip("the CPU bridges apply only without a GPU")
    assert os.environ.get(cpu.CPU_ENGINE_ENV) == "1"
    assert "torch_native" in DRAFT_ATTENTION_BACKEND_CHOICES
    import sgl_kernel

    assert getattr(sgl_kernel, "STAND_IN", False) == (not cpu.real_sgl_kernel_imports())
    torch.zeros(2).record_stream(None)  # a no-op on CPU tensors
    if getattr(sgl_kernel, "STAND_IN", False):  # the Qwen3.5 / GDN CPU ops SGLang binds at import time
        from sgl_kernel.mamba import chunk_gated_delta_rule_cpu  # noqa: F401

        from dspine.sglang.cpu_kernels import TORCH_OPS

        assert all(hasattr(torch.ops.sgl_kernel, name) for name in TORCH_OPS)
    import sglang.kernels.ops.attention.linear.gdn_replayssm_spec_decode as ring
    import sglang.kernels.ops.mamba.mamba_state_scatter_triton as scatter

    for fn in (ring.gdn_replayssm_spec_decode, ring.commit_gdn_replayssm_spec, ring.commit_gdn_replayssm_circular,
               scatter.fused_conv_window_scatter_with_mask):
        assert getattr(fn, "_dspine_cpu", False), fn.__name__


def test_cpu_kernel_stand_ins_do_what_their_names_say():
    from dspine.sglang import cpu_kernels as k

    r2t = torch.zeros(3, 10, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), r2t, torch.tensor([1, 4]), torch.tensor([3, 5]),
                                   torch.tensor([7, 8, 9]), 10)
    assert r2t[2, 1:3].tolist() == [7, 8] and r2t[0, 4].item() == 9 and r2t.sum().item() == 24
    out = torch.zeros(3, dtype=torch.int64)
    k.assign_extend_cache_locs_cpu(torch.tensor([2, 0]), r2t, torch.tensor([1, 4]), torch.tensor([3, 5]), out, 10)
    assert out.tolist() == [7, 8, 9]
    out = torch.zeros(4, dtype=torch.int64)
    k.assign_draft_cache_locs_contiguous_cpu(torch.tensor([2, 0]), r2t, torch.tensor([1, 3]), out, 10, 1, 2)
    assert out.tolist() == [7, 8, 0, 9]
    buf = torch.arange(12, dtype=torch.float32).view(4, 3)
    ptrs = torch.tensor([buf.data_ptr()], dtype=torch.int64)
    k.copy_all_layer_kv_cache_cpu(ptrs, torch.tensor([buf.stride(0) * 4]), torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert buf[:3].tolist() == [[3, 4, 5], [6, 7, 8], [6, 7, 8]]


def test_torch_chain_sampling_is_rejection_sampling():
    """Accept x while u*q(x) < p(x); then draw from max(p - q, 0) (p when all drafts were accepted)."""
    from dspine.sglang.cpu_kernels import chain_speculative_sampling

    V, slots = 4, 3
    p = torch.tensor([[[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]]])
    q = torch.zeros(1, slots - 1, V)
    q[0, 0, 1], q[0, 1, 3] = 1.0, 1.0
    cand = torch.tensor([[9, 1, 3]])
    idx = torch.tensor([[0, 1, 2]])

    def run(u, u_final):
        pred, acc_idx, n = torch.full((3,), -1), torch.full((1, 3), -1), torch.zeros(1, dtype=torch.int64)
        chain_speculative_sampling(pred, acc_idx, n, cand, idx, torch.tensor([u]), torch.tensor([u_final]), p, q)
        return pred.tolist(), int(n[0])

    assert run([0.5, 0.2], 0.5) == ([1, 3, 2], 2)  # both accepted; bonus from p of slot 2 (all mass on 2)
    pred, n = run([0.5, 0.3], 0.0)  # slot 2 rejected (0.3 * 1 >= 0.25): residual max(p - q, 0) = 0.25,.25,.25,0
    assert n == 1 and pred[:2] == [1, 0]
    pred, n = run([0.7, 0.0], 0.99)  # slot 1 rejected: residual (0.1, 0, 0.2, 0.1) -> last index with mass
    assert n == 0 and pred[0] == 3


def test_vocab_candidates_keep_top_k_columns_when_the_draft_vocabulary_is_smaller():
    V, H, k = 10, 4, 5
    vocab = torch.tensor([1, 4, 6])
    head = torch.randn(V, H)
    normed = torch.randn(2, H)
    pad = dm.pad_candidate_ids(vocab, V, k)
    ids, vals = dm.vocab_candidates(normed, head[vocab], vocab, k, pad)
    assert ids.shape == vals.shape == (2, k)
    assert set(ids[:, :3].flatten().tolist()) <= {1, 4, 6} and ids[0, 3:].tolist() == [0, 2]
    assert torch.isneginf(vals[:, 3:]).all() and torch.isfinite(vals[:, :3]).all()
    scores = torch.zeros(2, 1, k, k)
    masked = scores.masked_fill(torch.isneginf(vals.view(2, 1, k))[:, :, None, :], float("-inf"))
    tokens, q = dm.walk(ids.view(2, 1, k), masked, torch.tensor([[0.99], [0.99]]), torch.ones(2),
                        torch.tensor([False, False]))
    assert set(tokens.flatten().tolist()) <= {1, 4, 6} and (q[..., 3:] == 0).all()


def test_min_tokens_holds_back_the_same_stop_ids_as_the_reference_engine():
    """Issue 51: SGLang's ``min_new_tokens`` (and its stop check) also use the tokenizer's "additional stop tokens"
    (``<|eom_id|>``...), which the reference engine does not stop on. In the engines the batch tool starts that
    list stays empty, so both hold back and stop on the request's stop ids (which the batch tool fills with the EOS
    ids of the tokenizer and the model's configs), SGLang's ``eos_token_ids`` and the tokenizer's EOS."""
    code = """
import json
from types import SimpleNamespace as NS
from dspine.sglang import plugin
plugin.register()
from sglang.srt.utils.hf_transformers import tokenizer as t
from dspine.sglang.processing import stop_ids
tok = NS(get_added_vocab=lambda: {"<|eom_id|>": 7, "<|eot_id|>": 9}, eos_token_id=9)
t.attach_additional_stop_token_ids(tok)
req = NS(sampling_params=NS(stop_token_ids={9, 3}), eos_token_ids={9}, tokenizer=tok)
print(json.dumps(stop_ids(req)))
"""
    from dspine.sglang.sampling import engine_env

    ours = _run(code, env=engine_env())
    theirs = _run(code, env={k: "" for k in engine_env()})
    assert ours.returncode == 0 and theirs.returncode == 0, ours.stderr[-2000:] + theirs.stderr[-2000:]
    assert json.loads(ours.stdout.strip().splitlines()[-1]) == [3, 9]  # the request's stop ids (EOS among them)
    assert json.loads(theirs.stdout.strip().splitlines()[-1]) == [3, 7, 9]  # SGLang by hand keeps its own
