"""``dspine``: the library's own commands (inspect models, make a random draft, run a quick generation).

The batch product is ``dspine-batch``; this CLI is for people working on drafts and targets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dspine-batch")
def main() -> None:
    """DSpine library commands.

    \b
    Examples:
      dspine info path/to/hf-model
      dspine init-draft path/to/hf-model out/draft --layers 2 --block-size 8
      dspine run path/to/hf-model --draft out/draft --prompt-ids 1,2,3 --max-new-tokens 16
      dspine train embedded data.jsonl out/draft --layers 2 --block-size 8 --steps 500
    """


def _target_path(path: str) -> Path:
    """MODEL argument -> directory; 'embedded' is the converted SmolLM2 (a clear error if not installed); a .gguf
    file is converted once into the per-machine cache."""
    from dspine import ModelLoadError

    if path == "embedded":
        from dspine.embedded.smollm2 import embedded_target_path

        try:
            return embedded_target_path()
        except ModelLoadError as e:
            raise click.ClickException(str(e)) from None
    if path.lower().endswith(".gguf") and Path(path).is_file():  # converted once into the per-machine cache
        from dspine.embedded.gguf_convert import GGUFConversionError, gguf_model_path

        try:
            return gguf_model_path(path)
        except GGUFConversionError as e:
            raise click.ClickException(" ".join(str(e).split())) from None
    return Path(path)


def _load_target(path: str):
    from dspine import ModelLoadError, load_target

    try:
        return load_target(_target_path(path))
    except ModelLoadError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("model")
def info(model: str) -> None:
    """Print a target's family, what runs on our CPU kernels, which features are on, and its default draft taps
    (MODEL: dir, FILE.gguf or 'embedded'). An unsupported architecture is refused in one line listing the
    supported families."""
    from dspine.models.summary import summarize

    click.echo(json.dumps(summarize(_load_target(model)), indent=2))


@main.command("init-draft")
@click.argument("model")
@click.argument("out")
@click.option("--layers", default=5, show_default=True, help="draft decoder layers")
@click.option("--block-size", default=16, show_default=True, help="block size, anchor slot included")
@click.option("--seed", default=0, show_default=True)
def init_draft_cmd(model: str, out: str, layers: int, block_size: int, seed: int) -> None:
    """Write a randomly initialised DSpine draft for MODEL to OUT (writes zero: equals the causal DFlash)."""
    from dspine import init_draft

    d = init_draft(_load_target(model), num_layers=layers, block_size=block_size, seed=seed)
    d.save(out)
    click.echo(out)


def _training_inputs(model: str, data: str, max_len: int, draft_dir: str | None, teacher_forced: bool = False):
    """Target (CUDA when available), the draft in ``draft_dir`` (or None) and DATA's examples, for ``train``
    and ``fit-confidence``; load and data errors become one-line click errors."""
    import torch

    from dspine import ModelLoadError, load_draft, load_target
    from dspine.training.train import load_examples

    path = _target_path(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        # torch's linears, not dspine.cpu.kernels: training forwards are prefill-shaped (hundreds of rows), where
        # the decode-shaped kernels run ~2x slower than MKL (a 652-token capture: 2.7 s vs 1.4 s, AVX2 EPYC)
        target = load_target(path, device=device, kernels=False)
        draft = load_draft(draft_dir, device=device) if draft_dir else None
    except ModelLoadError as e:
        raise click.ClickException(str(e)) from None
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from dspine.models.tokenizer import HFTokenizer

        tokenizer = HFTokenizer(path)
    try:
        examples = load_examples(data, tokenizer, max_len=max_len, teacher_forced=teacher_forced)
    except (ValueError, KeyError) as e:
        raise click.ClickException(f"{data}: {e}") from None
    if not examples:
        raise click.ClickException(f"{data}: no usable examples (need >= 2 response tokens)")
    return target, draft, examples


@main.command()
@click.argument("model")
@click.argument("data", type=click.Path(exists=True, dir_okay=False))
@click.argument("out")
@click.option("--init", "init_from", default=None, help="warm-start from this draft dir (else a fresh draft)")
@click.option("--steps", default=1000, show_default=True, help="optimiser steps")
@click.option("--lr", default=6e-4, show_default=True)
@click.option("--batch-size", default=4, show_default=True, help="sequences per optimiser step")
@click.option("--layers", default=2, show_default=True, help="draft decoder layers (fresh draft only)")
@click.option("--block-size", default=16, show_default=True, help="block size, anchor slot included (fresh only)")
@click.option("--intermediate-size", default=None, type=int, help="draft MLP width (default: the target's)")
@click.option("--transfer-rank", default=None, type=int, help="transfer-space rank r (default: min(1024, H))")
@click.option("--anchors", default=32, show_default=True, help="anchors (blocks) per sequence")
@click.option(
    "--train-block",
    default=None,
    type=int,
    help="train on blocks of this many slots (<= the draft's block; e.g. the decode.json block). Default: the draft's",
)
@click.option(
    "--draft-vocab",
    default=None,
    type=int,
    help="propose from the N most frequent response tokens only (fresh draft; cheaper head)",
)
@click.option("--max-len", default=1024, show_default=True, help="truncate sequences to this many tokens")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--time-budget", default=None, type=float, help="stop after N seconds (saves first); the lr schedule ends then"
)
@click.option("--save-every", default=100, show_default=True, help="checkpoint every N steps")
@click.option("--gamma", default=7.0, show_default=True, help="slot weights exp(-(k-1)/gamma)")
@click.option(
    "--autocast",
    type=click.Choice(["bfloat16"]),
    default=None,
    envvar="DSPINE_TRAIN_AUTOCAST",
    help="run the draft's forward/backward under bf16 autocast (fp32 master weights; ~1.7x faster steps on AMX CPUs)",
)
@click.option("--resume", is_flag=True, help="continue OUT's checkpoint (weights, optimiser, schedule, data cursor)")
@click.option(
    "--teacher-forced", is_flag=True, help="DATA is not MODEL's own text: train on MODEL's argmax labels (teacher.py)"
)
def train(
    model: str,
    data: str,
    out: str,
    init_from: str | None,
    steps: int,
    lr: float,
    batch_size: int,
    layers: int,
    block_size: int,
    intermediate_size: int | None,
    transfer_rank: int | None,
    anchors: int,
    train_block: int | None,
    draft_vocab: int | None,
    max_len: int,
    seed: int,
    time_budget: float | None,
    save_every: int,
    gamma: float,
    autocast: str | None,
    resume: bool,
    teacher_forced: bool,
) -> None:
    """Train a DSpine draft for MODEL on DATA (JSONL) and write a loadable draft dir to OUT.

    DATA lines hold ``prompt_ids``/``response_ids`` (token ids; the loss covers the response), or
    ``prompt``/``response`` text rendered with MODEL's chat template. Responses should be the target's own
    (regenerated) outputs, see docs/design.md, "The DSpine draft"; other text needs ``--teacher-forced`` (or
    ``"teacher_forced": true`` per line). Runs on CUDA when available, else CPU. ``--resume`` continues a stopped
    run exactly.
    """
    from dspine.training.train import TrainConfig, choose_draft_vocab
    from dspine.training.train import train as run_training
    from dspine.training.train_state import ResumeError

    target, draft, examples = _training_inputs(model, data, max_len, init_from, teacher_forced)
    overrides = {k: v for k, v in (("intermediate_size", intermediate_size), ("transfer_rank", transfer_rank)) if v}
    if draft_vocab and draft is None:
        overrides["draft_vocab"] = choose_draft_vocab(examples, draft_vocab, target.vocab_size)
    cfg = TrainConfig(steps=steps, lr=lr, batch_size=batch_size, anchors_per_seq=anchors, seed=seed,
                      time_budget_s=time_budget, save_every=save_every, gamma=gamma,
                      autocast=autocast, block_size=train_block)  # fmt: skip
    try:
        run_training(target, examples, out, cfg, draft=draft, num_layers=layers, block_size=block_size,
                     draft_overrides=overrides, log=lambda s: click.echo(s, err=True), resume=resume)  # fmt: skip
    except ResumeError as e:
        raise click.ClickException(str(e)) from None
    click.echo(out)


@main.command("fit-confidence")
@click.argument("model")
@click.argument("data", type=click.Path(exists=True, dir_okay=False))
@click.argument("draft_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", default=None, help="write the draft here (default: update DRAFT_DIR in place)")
@click.option("--sequences", default=256, show_default=True, help="sequences to fit on (20% held out for the report)")
@click.option("--anchors", default=32, show_default=True, help="blocks per sequence")
@click.option("--greedy", is_flag=True, help="label = greedy acceptance (default: 1 - TV at T=1)")
@click.option("--max-len", default=1024, show_default=True, help="truncate sequences to this many tokens")
@click.option("--seed", default=0, show_default=True)
def fit_confidence_cmd(
    model: str, data: str, draft_dir: str, out: str | None, sequences: int, anchors: int, greedy: bool,
    max_len: int, seed: int,
) -> None:  # fmt: skip
    """Fit the confidence head of the draft in DRAFT_DIR (frozen backbone) on DATA, so decoding can stop
    drafting early with ``dynamic_threshold`` (dspine-batch ``--engine-arg dynamic_threshold=X``).

    Example: ``dspine fit-confidence embedded out/train.jsonl out/draft --sequences 256``
    """
    from dspine.training.confidence import fit_confidence_on_examples

    target, draft, examples = _training_inputs(model, data, max_len, draft_dir)
    try:
        report = fit_confidence_on_examples(draft, target, examples, sequences, anchors_per_seq=anchors, seed=seed,
                                            greedy=greedy, log=lambda s: click.echo(s, err=True))  # fmt: skip
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    dest = Path(out or draft_dir)
    draft.save(dest)
    (dest / "confidence.json").write_text(json.dumps(report, indent=2) + "\n")
    click.echo(dest)


@main.command()
@click.argument("model")
@click.option("--draft", default=None, help="DSpine draft dir (omit for plain decoding)")
@click.option("--prompt-ids", required=True, help="comma-separated token ids")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
def run(model: str, draft: str | None, prompt_ids: str, max_new_tokens: int, temperature: float, seed: int) -> None:
    """Generate from token ids and print tokens and acceptance stats as JSON."""
    from dspine import generate, load_draft

    try:
        ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers", param_hint="--prompt-ids") from None
    t = _load_target(model)
    d = load_draft(draft).use_kernels() if draft else None  # packed like the target (a no-op off CPU/fp32)
    try:
        (o,) = generate(t, d, [ids], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    s = o.stats
    click.echo(
        json.dumps(
            {
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "verify_steps": s.verify_steps,
                "accept_length": s.accept_length,
                "accept_histogram": s.accept_histogram,
            }
        )
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
