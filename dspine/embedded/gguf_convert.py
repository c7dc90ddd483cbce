"""Convert a llama.cpp GGUF (``gguf_arch.ARCHITECTURES``; byte-level BPE tokenizer) into a Hugging Face model dir.

Why convert at all: our reference targets load plain HF directories (``config.json`` + safetensors), and
speculative decoding is checked for identity against fp32 logits, so a quantized GGUF is dequantized to
fp32 once and cached rather than re-read on every start. The output is a normal HF directory that
``dspine.models.registry.load_target`` (and transformers) can load without the ``gguf`` package.

What the conversion has to undo or rebuild:

- **Weights.** Every tensor is dequantized to fp32 with gguf's own reference dequantizer (the same one
  transformers uses for ``gguf_file=`` loading, so the two agree bit for bit). llama.cpp stores Q and K
  projections with each head's rows interleaved for its adjacent-pair RoPE kernel; HF Llama rotates
  halves, so :func:`unpermute_qk` puts the rows back.
- **Config.** Read from the ``{arch}.*`` metadata (``gguf_arch``: what differs per architecture); float32
  metadata values are written as the shortest
  decimal that round-trips through float32 (``1e-05``, not ``9.999999747378752e-06``), which is the value
  the original config held.
- **Tokenizer.** A GGUF carries the vocabulary, merges, special-token ids and chat template but no
  ``tokenizer.json``. We build one with the ``tokenizers`` library. The pre-tokenizer is chosen from
  ``tokenizer.ggml.pre`` and must reproduce llama.cpp's split for that name (for SmolLM2's ``smollm``:
  every digit on its own, then the GPT-2 byte-level regex); an unknown name is refused rather than
  guessed, because a wrong split gives plausible but different token ids.

``convert_cached`` wraps the conversion for a cache: one process converts while others wait
(``dspine.cpu.disk_cache.exclusive``), into a temporary sibling directory renamed into place, and it records the
source file's sha256 so a changed GGUF is converted again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from dspine.cpu.disk_cache import cache_root, exclusive, publish_dir, remove_temps, say, temp_sibling
from dspine.embedded import gguf_arch
from dspine.embedded.gguf_meta import GGUFConversionError, Metadata

# Bump when the output of ``convert_gguf`` changes, so caches written by an older converter are redone.
CONVERTER_VERSION = 1
MARKER_NAME = "dspine-source.json"

# llama.cpp token types (``tokenizer.ggml.token_type``).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# ``tokenizer.ggml.pre`` names whose llama.cpp split is "each \p{N} alone, then the GPT-2 regex"
# (llama-vocab.cpp groups them in one case), and those that use the GPT-2 regex alone.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_ONLY = {"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"}
# Names whose llama.cpp split is one regex (then byte-level without the GPT-2 regex): the Qwen2 tokenizers' (qwen2,
# also Qwen2.5 / Qwen3 GGUFs) and Llama 3's (llama-bpe; numbers in runs of up to three digits).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_REGEX_SPLITS = {"qwen2": _CONTRACTIONS + r"\p{N}" + _REST, "llama-bpe": _CONTRACTIONS + r"\p{N}{1,3}" + _REST}
# llama.cpp splits these as Llama 3 does (one case in llama-vocab.cpp): SmolLM3's smaug-bpe, dbrx
_REGEX_SPLITS.update({name: _REGEX_SPLITS["llama-bpe"] for name in ("smaug-bpe", "dbrx")})

_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFPackageMissing(GGUFConversionError):
    """The optional ``gguf`` package, needed only to convert, is not installed."""


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, streamed (the cache key: a changed source must be converted again)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for ``n_heads`` heads (use the KV head count for K).

    ``convert_hf_to_gguf.py`` maps each head's rows ``[first half | second half]`` (HF's rotate-half
    pairing, dims i and i + D/2) to interleaved pairs ``(2i, 2i+1)`` for llama.cpp's RoPE kernel, via
    ``reshape(H, 2, D/2, in).swapaxes(1, 2)``. The inverse is the same reshape with the 2 and D/2 swapped.
    """
    rows, cols = w.shape
    if rows % (2 * n_heads):
        raise GGUFConversionError(f"Q/K tensor with {rows} rows does not split into {n_heads} heads of even size")
    return np.ascontiguousarray(w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFPackageMissing(
            "converting a GGUF needs the `gguf` package: pip install gguf  (or the dspine-batch[gguf] extra)"
        ) from None
    return gguf


def _read_gguf(path: Path) -> tuple[Any, Metadata]:
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        raise GGUFConversionError(f"{path}: not a readable GGUF file ({e})") from None
    meta = Metadata(reader, path)
    try:
        gguf_arch.check_architecture(meta.text("general.architecture", required=True))
    except gguf_arch.ArchError as e:
        raise GGUFConversionError(f"{path}: {e}") from None
    return reader, meta


def _config(meta: Metadata, reader: Any) -> dict[str, Any]:
    """The HF config of the GGUF's architecture (``gguf_arch.config``), errors naming the file."""
    gguf = _import_gguf()
    extra = {t.name: np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
             for t in reader.tensors if t.name in gguf_arch.CONFIG_TENSORS}
    try:
        arch = meta.text("general.architecture", required=True)
        return gguf_arch.config(arch, meta, {t.name for t in reader.tensors}, extra)
    except gguf_arch.ArchError as e:
        raise GGUFConversionError(f"{meta.path}: {e}") from None


def _hf_names(reader: Any, arch: str, path: Path) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every tensor that is a weight (not ``CONFIG_TENSORS``); a tensor
    that is not one of ``arch``'s is refused."""
    out = {}
    for t in reader.tensors:
        if t.name in gguf_arch.CONFIG_TENSORS:  # read into the config (``_config``)
            continue
        out[t.name] = _hf_name(t.name, arch)
        if out[t.name] is None:
            raise GGUFConversionError(f"{path}: unexpected tensor {t.name!r} for a {arch} model")
    return out


def _hf_name(name: str, arch: str) -> str | None:
    """A GGUF weight's Hugging Face name; None for a name ``arch`` does not have."""
    block = gguf_arch.BLOCK_TENSORS[arch]
    parts = name.split(".", 2)  # "blk.7.attn_q.weight" -> ["blk", "7", "attn_q.weight"]
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{int(parts[1])}.{block[parts[2]]}"
    return None


def _check_layers(names: dict[str, str], meta: Metadata, arch: str, path: Path) -> None:
    """``{arch}.block_count`` against the layers the file holds tensors for, before anything is sized by it."""
    key = f"{arch}.block_count"
    blocks = meta.count(key)
    held = sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.")})
    if held != list(range(blocks)):
        have = f"layers {held[0]}-{held[-1]}" if held else "no layers"
        raise GGUFConversionError(f"{path}: metadata key {key!r} is {blocks}, but the file holds tensors for {have}"
                                  f"{'' if held == list(range(len(held))) else ' (with gaps)'}")


# config keys -> the metadata keys they come from, to name the ones a tensor's shape contradicts
_SIZES = (("hidden_size", "embedding_length"), ("intermediate_size", "feed_forward_length"),
          ("vocab_size", "vocab_size"), ("num_attention_heads", "attention.head_count"),
          ("num_key_value_heads", "attention.head_count_kv"), ("head_dim", "attention.key_length"))


def _check_shapes(reader: Any, names: dict[str, str], cfg: dict[str, Any], path: Path, arch: str) -> None:
    """Every tensor's shape (from the file's header: nothing is read) against the module the metadata describes,
    built on the meta device, before anything is dequantized or allocated: a file whose metadata claims sizes its
    tensors do not have (a feed-forward length of 2**36) fails here in one line naming the tensor and the keys."""
    from dspine.models.checkpoint import MissingTensor, ModelLoadError, ShapeMismatch, check_shapes
    from dspine.models.llama import DenseTarget

    stored = {t.name: (path, tuple(int(x) for x in reversed(t.shape.tolist())))
              for t in reader.tensors if t.name in names}
    shaped = DenseTarget.shaped(cfg)
    try:
        check_shapes({n: t.shape for n, t in shaped.state_dict().items()}, stored, path,
                     lambda n: shaped.checkpoint_name(names[n]))
    except MissingTensor as e:  # named as the file would name it
        local = [f"blk.{i}.{g}" for i in range(cfg["num_hidden_layers"]) for g in gguf_arch.BLOCK_TENSORS[arch]]
        gguf_name = next((g for g in [*_TOP_TENSORS, *local] if shaped.checkpoint_name(_hf_name(g, arch)) == e.name),
                         e.name)
        raise GGUFConversionError(f"{path}: tensor {gguf_name!r} is missing (the metadata's {arch} layers need "
                                  f"it)") from None
    except ShapeMismatch as e:
        wrong = {w for s, w in zip(e.shape, e.expected, strict=False) if s != w} or set(e.expected)
        keys = [f"{arch}.{k}" for c, k in _SIZES if cfg.get(c) in wrong] or [
            f"{arch}.{k}" for c, k in _SIZES if c in ("num_attention_heads", "num_key_value_heads", "head_dim")]
        raise GGUFConversionError(f"{path}: tensor {e.name!r} is {list(e.shape)}, but the metadata "
                                  f"({', '.join(keys)}) makes it {list(e.expected)}") from None
    except ModelLoadError as e:  # a tensor of the architecture's that this model has no place for
        raise GGUFConversionError(str(e)) from None


def _state_dict(reader: Any, names: dict[str, str], cfg: dict[str, Any], path: Path,
                arch: str) -> dict[str, torch.Tensor]:
    """All tensors dequantized to fp32 under HF names (``names``), as HF stores them (``gguf_arch.transform``:
    Llama's Q/K un-permuted, Gemma's norms back to ``w``)."""
    gguf = _import_gguf()
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name not in names:
            continue
        try:
            w = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy, off the mmap
        except (ValueError, NotImplementedError, IndexError) as e:
            raise GGUFConversionError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) cannot be read "
                                      f"({e})") from None
        w = gguf_arch.transform(arch, t.name, w, cfg, unpermute_qk)
        out[names[t.name]] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def _pre_tokenizer(pre: str | None, path: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_SPLITS:
        from tokenizers import Regex

        split = pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre is None or pre in _GPT2_ONLY:
        return byte_level
    raise GGUFConversionError(
        f"{path}: tokenizer pre-type {pre!r} is not supported "
        f"(known: {', '.join(sorted(_DIGITS_THEN_GPT2 | _GPT2_ONLY | set(_REGEX_SPLITS)))})"
    )


def _token_name(tokens: list[str], meta: Metadata, key: str) -> str | None:
    token_id = meta.token_id(f"tokenizer.ggml.{key}", len(tokens))
    return None if token_id is None else tokens[token_id]


def build_tokenizer(meta: Metadata) -> tuple[Tokenizer, dict[str, Any]]:
    """``(tokenizer, tokenizer_config)`` for a byte-level BPE GGUF vocabulary (a SentencePiece one: see
    ``_sentencepiece_tokenizer``).

    Control tokens become special added tokens (so ``<|im_start|>`` in a chat prompt stays one token and
    ``skip_special_tokens`` drops it); user-defined ones become plain added tokens, as llama.cpp matches
    both whole.
    """
    model = meta.text("tokenizer.ggml.model", required=True)
    if model == "llama":
        return _sentencepiece_tokenizer(meta)
    if model != "gpt2":
        raise GGUFConversionError(f"{meta.path}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' "
                                  f"and SentencePiece 'llama' are)")
    tokens: list[str] = meta.strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in meta.strings("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise GGUFConversionError(f"{meta.path}: malformed BPE merges")
    types = meta.integers("tokenizer.ggml.token_type", required=False) or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(types) != len(tokens):
        raise meta.fail("tokenizer.ggml.token_type", f"has {len(types)} entries for {len(tokens)} tokens")
    if len(vocab) != len(tokens):
        raise meta.fail("tokenizer.ggml.tokens", "holds a token twice")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.text("tokenizer.ggml.pre"), meta.path)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == _TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    add_bos = meta.flag("tokenizer.ggml.add_bos_token", False)
    return tok, _tokenizer_config(meta, tokens, add_bos, meta.flag("tokenizer.ggml.add_eos_token", False))


def _tokenizer_config(meta: Metadata, tokens: list[str], add_bos: bool, add_eos: bool) -> dict[str, Any]:
    """``tokenizer_config.json`` for a rebuilt vocabulary: load ``tokenizer.json`` verbatim (a model-specific class
    could rebuild the pre-tokenizer), the special tokens by name, the file's chat template."""
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token_name(tokens, meta, "bos_token_id"),
        "eos_token": _token_name(tokens, meta, "eos_token_id"),
        "unk_token": _token_name(tokens, meta, "unknown_token_id"),
        "pad_token": _token_name(tokens, meta, "padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.count(f"{meta.text('general.architecture', required=True)}.context_length"),
    }
    template = meta.text("tokenizer.chat_template")
    if template is not None:
        tok_cfg["chat_template"] = template
    return tok_cfg


def _sentencepiece_tokenizer(meta: Metadata) -> tuple[Tokenizer, dict[str, Any]]:
    """``(tokenizer, tokenizer_config)`` for a SentencePiece GGUF vocabulary (``tokenizer.ggml.model`` "llama": Llama
    2, Mistral, Gemma 3, Phi-3 files). Rebuilt by transformers' GGUF tokenizer converter (merges recovered from the
    scores, or for Gemma from the vocabulary's order; Phi-3's prefix space as a normalizer; control and user-defined
    tokens kept whole): the library made for it, fed from our reader so that every array is read in full."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        import transformers

        raise GGUFConversionError(f"{meta.path}: a SentencePiece vocabulary (tokenizer model 'llama') is rebuilt by "
                                  f"transformers' GGUF converter, which transformers {transformers.__version__} "
                                  f"lacks (pip install 'transformers>=5.25')") from None
    arch = meta.text("general.architecture", required=True)
    tokens = meta.strings("tokenizer.ggml.tokens")
    spec: dict[str, Any] = {"tokenizer_type": "llama", "tokens": tokens,
                            "scores": [float(x) for x in meta.numbers("tokenizer.ggml.scores", required=False)
                                       or [0.0] * len(tokens)],
                            "token_type": [int(x) for x in meta.integers("tokenizer.ggml.token_type", required=False)
                                           or [1] * len(tokens)]}
    for key in ("scores", "token_type"):
        if len(spec[key]) != len(tokens):
            raise meta.fail(f"tokenizer.ggml.{key}", f"has {len(spec[key])} entries for {len(tokens)} tokens")
    merges = meta.strings("tokenizer.ggml.merges", required=False)
    if merges:
        spec["merges"] = list(merges)
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("unknown_token_id", "unk_token_id"), ("padding_token_id", "pad_token_id")):
        token_id = meta.token_id(f"tokenizer.ggml.{key}", len(tokens))
        if token_id is not None:
            spec[name] = token_id
    try:
        tok, _ = convert_gguf_tokenizer(arch, spec)
    except Exception as e:  # the converter's own errors, named by file and one line
        raise GGUFConversionError(f"{meta.path}: SentencePiece vocabulary: {str(e).splitlines()[0]}") from None
    bos, eos = _token_name(tokens, meta, "bos_token_id"), _token_name(tokens, meta, "eos_token_id")
    add_bos = meta.flag("tokenizer.ggml.add_bos_token", True)  # llama.cpp's default for SentencePiece
    add_eos = meta.flag("tokenizer.ggml.add_eos_token", False)
    # BOS/EOS as tokenizer.json's post-processor (what a fast tokenizer reads; the converter leaves it empty)
    first = [bos] if add_bos and bos else []
    last = [eos] if add_eos and eos else []
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join([*first, "$A", *last]), pair=" ".join([*first, "$A", *last, *first, "$B:1", *last]),
        special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(first + last)])
    return tok, _tokenizer_config(meta, tokens, add_bos, add_eos)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write an HF directory for ``gguf_path`` into ``out_dir`` (created; existing files overwritten).

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32), ``tokenizer.json``,
    ``tokenizer_config.json`` and ``special_tokens_map.json``. Not atomic: see :func:`convert_cached`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader, meta = _read_gguf(gguf_path)
    arch = meta.text("general.architecture", required=True)
    names = _hf_names(reader, arch, gguf_path)
    _check_layers(names, meta, arch, gguf_path)  # before the config sizes anything by the layer count
    cfg = _config(meta, reader)
    _check_shapes(reader, names, cfg, gguf_path, arch)
    tokenizer, tok_cfg = build_tokenizer(meta)
    if tokenizer.get_vocab_size(with_added_tokens=True) != cfg["vocab_size"]:
        raise GGUFConversionError(
            f"{gguf_path}: tokenizer has {tokenizer.get_vocab_size()} tokens, "
            f"the model's vocabulary {cfg['vocab_size']}"
        )
    state = _state_dict(reader, names, cfg, gguf_path, arch)

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    specials = {k: tok_cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if tok_cfg[k]}
    for name, obj in (
        ("config.json", cfg),
        ("generation_config.json", ids),
        ("tokenizer_config.json", tok_cfg),
        ("special_tokens_map.json", specials),
    ):
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _marker(source: Path, sha256: str) -> dict[str, Any]:
    return {"source_name": source.name, "source_sha256": sha256, "converter_version": CONVERTER_VERSION}


def cache_is_valid(out_dir: str | Path, sha256: str) -> bool:
    """Whether ``out_dir`` holds a complete conversion of the file with this sha256 by this converter."""
    try:
        marker = json.loads((Path(out_dir) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_sha256") == sha256 and marker.get("converter_version") == CONVERTER_VERSION


def convert_cached(gguf_path: str | Path, out_dir: str | Path, expected_sha256: str | None = None) -> Path:
    """Return ``out_dir``, first converting ``gguf_path`` into it unless it holds this file's conversion.

    The conversion is written to a temporary sibling and renamed into place with the marker inside, so a
    crash never leaves a directory that looks complete, and concurrent callers each see a whole one.
    ``expected_sha256`` (e.g. from the installing wheel's RECORD) turns a damaged source into an error
    instead of a silently different model.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        digest = file_sha256(gguf_path)
    except OSError as e:
        raise GGUFConversionError(f"{gguf_path}: cannot be read ({e.strerror or e})") from None
    if expected_sha256 is not None and digest != expected_sha256:
        raise GGUFConversionError(
            f"{gguf_path}: sha256 {digest[:12]}… is not the expected {expected_sha256[:12]}… (damaged)"
        )
    if cache_is_valid(out_dir, digest):
        return out_dir
    # One process converts while the others wait (an flock its holder's death releases); a converter killed
    # half-way leaves only its temporary, which the next one removes.
    with exclusive(out_dir.parent / f"{out_dir.name}.lock", f"converting {gguf_path.name}"):
        if cache_is_valid(out_dir, digest):  # converted by the process we waited for
            return out_dir
        remove_temps(out_dir)
        t0 = time.monotonic()
        # the embedded 93 MB Q4_1 file took 5.7 s on an idle 2-core EPYC (dequantized to fp32: ~6 s per 100 MB)
        expect = max(5, round(gguf_path.stat().st_size / 16e6))
        say(f"converting {gguf_path.name} to a Hugging Face model folder in {out_dir} (~{expect} s on an idle CPU, "
            "once per cache)")
        # A plain mkdir (not mkdtemp's 0700) so the cache gets the umask's permissions and can be shared.
        tmp = temp_sibling(out_dir)
        tmp.mkdir(parents=True)
        try:
            convert_gguf(gguf_path, tmp)
            (tmp / MARKER_NAME).write_text(json.dumps(_marker(gguf_path, digest), indent=2) + "\n")
            file_mode = tmp.stat().st_mode & 0o666  # safetensors writes 0600 files; align them with the dir
            for f in tmp.iterdir():
                f.chmod(file_mode)
            publish_dir(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"converted in {time.monotonic() - t0:.1f} s")
    return out_dir


def gguf_model_path(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """``--model FILE.gguf``: the HF directory of a user's GGUF, converted once into the per-machine cache
    (``$DSPINE_CACHE_DIR/gguf/<name>-<digest of its path>``; ``convert_cached`` redoes it when the file's content
    changes). ``GGUFConversionError`` (one line, naming the file and what is unsupported) otherwise."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFConversionError(f"{gguf_path}: no such GGUF file")
    key = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:12]
    out = Path(cache_dir) if cache_dir is not None else cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_cached(gguf_path, out)
