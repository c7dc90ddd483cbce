"""``dspine``: the library's own commands (inspect models, make a random draft, run a quick generation).

The batch product is ``dspine-batch``; this CLI is for people working on drafts and targets.
"""

from __future__ import annotations

import json
import sys

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
    """


def _load_target(path: str):
    from dspine import ModelLoadError, load_target

    if path == "embedded":
        from dspine.embedded import embedded_target_path

        path = str(embedded_target_path())
    try:
        return load_target(path)
    except ModelLoadError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("model")
def info(model: str) -> None:
    """Print a target's architecture summary and its default draft taps (MODEL: dir or 'embedded')."""
    t = _load_target(model)
    click.echo(
        json.dumps(
            {
                "class": type(t).__name__,
                "model_type": t.config.get("model_type"),
                "layers": t.num_layers,
                "hidden_size": t.hidden_size,
                "vocab_size": t.vocab_size,
                "max_position": t.max_position,
                "default_tap_ids": t.default_tap_ids(min(5, t.num_layers)),
                "parameters": sum(p.numel() for p in t.parameters()),
            },
            indent=2,
        )
    )


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
    d = load_draft(draft) if draft else None
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
