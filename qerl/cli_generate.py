"""`qerl generate ADAPTER`: try a trained adapter on this machine, beside the base model without it.

The adapter directory is what `qerl adapters download` extracts (or `qerl train` writes; a job id,
adapter id or ``ft:`` model name is downloaded from the server first, or with ``--checkpoint`` or a
checkpoint's ``ft:...:ckpt-step-N`` name the LoRA of that checkpoint): PEFT's files and
`qerl_manifest.json`, which names the base model and the format its weights were held in
while the adapter trained (the same format is used here, so the answers are the trained policy's).
The prompts are chat messages (the base's chat template applied, as in training); sampling is
greedy unless a temperature is given.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from engine.score import framed_chat, read_manifest
from qerl.cli_client import ApiKey, BaseUrl, _errors_as_messages
from qerl.term import rule, stdout_console

console = stdout_console()


SERVER_REFS = ("ftjob-", "adapter-", "ft:")
# the options generate and eval share: which adapter, on which base, asked how
AdapterRef = Annotated[str, typer.Argument(
    metavar="ADAPTER", help="an adapter directory (qerl adapters download, qerl train), or from the server: "
    "a job id (ftjob-...), an adapter id or a fine-tuned model (ft:...)")]
System = Annotated[Optional[str], typer.Option(
    help="a system message before each prompt (in place of the one training used)")]
Framing = Annotated[bool, typer.Option(
    help="ask plain prompts as training asked its questions: after its format instruction and "
    "worked example, from the adapter's manifest (--no-framing: as given)")]
Base = Annotated[Optional[str], typer.Option(help="the base model (default: the adapter's manifest)")]
Quantization = Annotated[Optional[str], typer.Option(help="nvfp4 | nf4 | bf16 (default: what the adapter trained on)")]
Device = Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")]
_CHECKPOINT_NAME = re.compile(r"^(ft:.+):ckpt-step-(\d+)$")  # a checkpoint's fine_tuned_model_checkpoint


def _fetch(ref: str, checkpoint: int | None, base_url: str | None, api_key: str | None) -> Path:
    """A succeeded job's adapter, an adapter id's or a fine-tuned model's, or (``checkpoint``, or a
    ``ft:...:ckpt-step-N`` name) the LoRA of one of its job's checkpoints, from the server, into
    ``$QERL_CACHE_DIR/adapters/<adapter or checkpoint id>`` (sha256-checked, extracted beside it and
    renamed into place; kept for the next time)."""
    from qerl.cli_client import _checkpoint_at
    from qerl.client import Client

    named = _CHECKPOINT_NAME.match(ref)
    if named:
        if checkpoint is not None and checkpoint != int(named.group(2)):
            raise typer.BadParameter(f"{ref} names step {named.group(2)}; leave out --checkpoint {checkpoint}",
                                     param_hint="--checkpoint")
        ref, checkpoint = named.group(1), int(named.group(2))
    with Client(base_url=base_url, api_key=api_key) as client:
        if checkpoint is None:
            adapter_id = client.adapter_id_of(ref)
            return _cached(adapter_id, lambda part: client.download_adapter(adapter_id, part))
        if ref.startswith("ftjob-"):
            job_id = ref
        else:
            adapter_id = client.adapter_id_of(ref)
            job_id = next((a["job_id"] for a in client.adapters() if a["id"] == adapter_id), None)
        if not job_id:
            raise typer.BadParameter(f"{ref} names no job whose checkpoints to look in", param_hint="ADAPTER")
        c = _checkpoint_at(client, job_id, checkpoint)
        return _cached(c["id"], lambda part: client.download_checkpoint(job_id, c["id"], part))


def _cached(name: str, download: Callable[[Path], Any]) -> Path:
    """``$QERL_CACHE_DIR/adapters/<name>``, downloaded (into a temporary name, renamed into place)
    when it is not there yet."""
    import os
    import shutil

    from engine.model.gguf import cache_root

    target = cache_root() / "adapters" / name
    if not (target / "adapter_config.json").is_file():
        part = target.with_name(f".{name}.{os.getpid()}.part")
        shutil.rmtree(part, ignore_errors=True)
        console.print(f"[dim]downloading {name} to {target}[/]")
        try:
            download(part)
            if not target.exists():
                part.rename(target)
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return target


def resolve_adapter(adapter_ref: str, checkpoint: int | None, base_url: str | None, api_key: str | None) -> Path:
    """The adapter directory ADAPTER names: a directory as it is, a job id, adapter id or ``ft:``
    name downloaded from the server (``checkpoint``: that checkpoint's LoRA)."""
    adapter = Path(adapter_ref)
    if not adapter.exists() and adapter_ref.startswith(SERVER_REFS):
        return _fetch(adapter_ref, checkpoint, base_url, api_key)
    if checkpoint is not None:
        raise typer.BadParameter("--checkpoint picks a checkpoint of a job on the server: give a job id, adapter id "
                                 "or ft: name (a directory is one adapter already)", param_hint="--checkpoint")
    return adapter


@contextmanager
def adapter_errors() -> Iterator[None]:
    """engine.score's adapter errors as the command line says them: the argument or option to
    change, or (loading failed) a red line and exit code 2."""
    from engine.score import AdapterLoadError, AdapterOptionError, NotAnAdapter

    try:
        yield
    except NotAnAdapter as exc:
        raise typer.BadParameter(f"{exc}; `qerl adapters download ID -o DIR` extracts one",
                                 param_hint="ADAPTER") from None
    except AdapterOptionError as exc:
        fix = "; give --base" if exc.option == "base" else ""
        raise typer.BadParameter(f"{exc}{fix}", param_hint=f"--{exc.option}") from None
    except AdapterLoadError as exc:
        console.print(f"[red]cannot load {escape(exc.base)} with the adapter in {exc.adapter}: {escape(exc.reason)}[/]")
        raise typer.Exit(2) from None


def adapter_manifest(adapter: Path) -> dict[str, Any]:
    """The adapter's ``qerl_manifest.json`` ({} for a PEFT directory without one)."""
    with adapter_errors():
        return read_manifest(adapter)


def adapter_facts(adapter: Path) -> tuple[str, str, list[dict[str, str]]]:
    """(base model, quantization, prompt framing) the adapter was trained with (engine.score)."""
    from engine.score import adapter_facts as facts

    with adapter_errors():
        return facts(adapter)


def read_rows(path: Path, param: str) -> list[tuple[int, dict[str, Any]]]:
    """(line, row) of a JSONL file of prompts, each checked as an upload's rows are; a bad line is
    an error naming it."""
    from engine.score import read_test_rows
    from engine.types import TrainError

    try:
        return read_test_rows(path)
    except TrainError as exc:
        raise typer.BadParameter(str(exc), param_hint=param) from None


def _prompts(prompt: list[str], prompts_file: Path | None, system: str | None,
             framing: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """Chat messages per prompt: each --prompt a user turn, each line of --prompts-file a JSON object
    with ``messages`` or ``prompt`` (framed_chat)."""
    out = [framed_chat({"prompt": p}, system, framing) for p in prompt]
    if prompts_file is not None:
        out += [framed_chat(row, system, framing) for _, row in read_rows(prompts_file, "--prompts-file")]
    if not out:
        raise typer.BadParameter("give at least one --prompt TEXT or a --prompts-file", param_hint="--prompt")
    return out


@_errors_as_messages
def generate_cmd(
    adapter_ref: AdapterRef,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="a user message (repeatable)")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(
        help="JSON lines: {\"messages\": [...]} or {\"prompt\": \"...\"}", exists=True, dir_okay=False)] = None,
    system: System = None,
    framing: Framing = True,
    base: Base = None,
    quantization: Quantization = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, max=32768)] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, max=100.0, help="0: greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    seed: Annotated[int, typer.Option(help="sampling seed (temperature > 0)")] = 0,
    checkpoint: Annotated[Optional[int], typer.Option(
        help="from the server: the LoRA at this checkpoint step of the job (or of the job that made the "
        "fine-tuned model) instead of its final adapter; a checkpoint's name ft:...:ckpt-step-N says the same")] = None,
    compare: Annotated[bool, typer.Option(help="also answer with the base model alone")] = True,
    device: Device = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, one per prompt")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Answer prompts with a fine-tuned adapter on its base model (and with the base alone)."""
    import torch

    from engine.lora import lora_disabled
    from engine.rollout.backend import native_generate
    from engine.rollout.params import SamplingParams
    from engine.train_batch import apply_chat_template

    if not prompt and prompts_file is None:
        raise typer.BadParameter("give at least one --prompt TEXT or a --prompts-file", param_hint="--prompt")
    adapter = resolve_adapter(adapter_ref, checkpoint, base_url, api_key)
    trained_base, trained_format, trained_framing = adapter_facts(adapter)
    chats = _prompts(prompt or [], prompts_file, system, trained_framing if framing else [])
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--top-p") from None
    model, tokenizer, base_model, fmt, dev = load_adapted(adapter, base, quantization, device)
    ids = [apply_chat_template(tokenizer, chat) for chat in chats]

    def answer() -> list[Any]:
        gen = torch.Generator(device=dev).manual_seed(seed)
        return native_generate(model, tokenizer, ids, params, generator=gen)

    tuned = answer()
    alone = None
    if compare:
        with lora_disabled(model):
            alone = answer()
    for i, chat in enumerate(chats):
        got = tuned[i]
        row: dict[str, Any] = {"model": base_model, "quantization": fmt, "messages": chat,
                               "completion": tokenizer.decode(got.token_ids, skip_special_tokens=True),
                               "finish_reason": got.finish_reason, "tokens": len(got.token_ids),
                               "token_ids": list(got.token_ids)}
        if alone is not None:
            row["base_completion"] = tokenizer.decode(alone[i].token_ids, skip_special_tokens=True)
            row["base_token_ids"] = list(alone[i].token_ids)
        if as_json:
            print(json.dumps(row), flush=True)
            continue
        rule(console, f"prompt {i + 1}")
        console.print(escape(chat[-1]["content"]))
        console.print(f"[bold green]fine-tuned[/] ({row['tokens']} tokens, {row['finish_reason']}):")
        console.print(escape(row["completion"]))
        if alone is not None:
            console.print(f"[bold]base alone[/] ({len(alone[i].token_ids)} tokens, {alone[i].finish_reason}):")
            console.print(escape(row["base_completion"]))
    if not as_json:
        console.print(f"[dim]{escape(base_model)} ({fmt}) with the adapter in {adapter}, on {dev}[/]")
        if framing and trained_framing:
            shots = sum(m.get("role") == "assistant" for m in trained_framing)
            console.print(f"[dim]plain prompts asked as in training: after its "
                          f"{'system turn and ' if any(m.get('role') == 'system' for m in trained_framing) else ''}"
                          f"{shots} worked example{'s' if shots != 1 else ''} (--no-framing: as given)[/]")


def load_adapted(adapter: Path, base: str | None, quantization: str | None,
                 device: str) -> tuple[Any, Any, str, str, Any]:
    """(model, tokenizer, base model, format, device): engine.score.load_adapted, its errors
    said as options to change."""
    from engine.score import load_adapted as load

    with adapter_errors():
        return load(adapter, base, quantization, device)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
