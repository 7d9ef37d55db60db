"""`minicpm voice add|list|rm`: the saved voices (voices.store)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

voice_app = typer.Typer(
    help="Saved voices: recordings kept under a name, for --voice NAME and a server's voice field.",
    no_args_is_help=True,
)


@voice_app.command("add")
def voice_add(
    name: Annotated[str, typer.Argument(help="The voice's name: letters, digits, - and _.", show_default=False)],
    file: Annotated[str, typer.Argument(help="A recording of the voice (wav, flac, ogg; 0.5-30 s).", show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Replace a saved voice of that name.")] = False,
) -> None:
    """Save a recording's voice as NAME (its 16 kHz samples, as --voice FILE reads them). Clone only
    voices you have the right to use."""
    from ...voices.store import VoiceStore

    store = VoiceStore()
    saved = store.add(name, file, force=force)
    print(f"minicpm: saved voice '{saved.name}' ({saved.seconds:.1f} s) in {store.root}", file=sys.stderr)


@voice_app.command("list")
def voice_list() -> None:
    """List the saved voices: name, seconds, when added, what from (a table on stdout)."""
    from ...errors import VoiceError
    from ...voices.store import VoiceStore

    store = VoiceStore()
    rows = []
    for name in store.names():
        try:
            v = store.get(name)
        except VoiceError as e:  # (one unreadable file does not hide the others)
            print(f"minicpm: warning: {e}", file=sys.stderr)
            continue
        added = v.added.astimezone().strftime("%Y-%m-%d %H:%M") if v.added else "-"
        rows.append((v.name, f"{v.seconds:.1f}", added, v.source or "-"))
    if not rows:
        print(f"minicpm: no saved voices in {store.root} (minicpm voice add NAME FILE)", file=sys.stderr)
        return
    rows.insert(0, ("NAME", "SECONDS", "ADDED", "FROM"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        sys.stdout.write(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}\n")


@voice_app.command("rm")
def voice_rm(name: Annotated[str, typer.Argument(help="The saved voice to remove.", show_default=False)]) -> None:
    """Remove a saved voice."""
    from ...voices.store import VoiceStore

    VoiceStore().remove(name)
