"""Saved voices: reference recordings kept under a name, for `--voice NAME` and the server's `voice`.

A saved voice is one file, `NAME.wav` in the voices directory (`$XDG_DATA_HOME/minicpm/voices`, by
default `~/.local/share/minicpm/voices`): the 16 kHz mono float32 samples `voice.load_reference`
returned for the recording it was made from, as a float WAV, so reading it back gives exactly those
samples (and any audio tool plays it); when it was added and what it was made from are the WAV's own
date and comment strings. A voice is written to a temporary name in the directory and renamed into
place, so a reader sees a whole voice or none, and a name in use is replaced only when asked (`force`).

`locate(ref)` is what a voice reference means, everywhere one is taken (`--voice REF`, the server's
`voice`, `bulk`'s voice column): a path to an existing file (where files are taken: not from a
server's clients), else `default` (the model's own voice: no cloning), else the name of a saved
voice, else (where OpenAI's names are taken: the server) one of OpenAI's voice names, which speak
the model's own voice, else an UnknownVoice error. `resolve(ref)` reads what it names. Names
are ASCII letters, digits, `-` and `_`, starting with a letter or digit, at most 64 characters (so a
name is never a path, nor taken for an option), and not `default`, which always means the model's own
voice (so a request for it gives the same audio whatever voices a server has saved).

numpy and soundfile only, no torch: the thin client resolves voices too.
"""

from __future__ import annotations

import datetime
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import OptionError, VoiceError
from ..files import new_file_mode
from ..protocol import DEFAULT_VOICE, OPENAI_VOICES
from .reference import SAMPLE_RATE, Voice, load_reference

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SUFFIX = ".wav"


def default_dir() -> Path:
    """`$XDG_DATA_HOME/minicpm/voices`; XDG_DATA_HOME unset, empty or relative means ~/.local/share."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "minicpm" / "voices"


def is_name(name: str) -> bool:
    return NAME.fullmatch(name) is not None and name != DEFAULT_VOICE


def check_name(name: str) -> str:
    if name == DEFAULT_VOICE:
        raise OptionError(f"'{DEFAULT_VOICE}' is the model's own voice and cannot name a saved one: choose another name")
    if not is_name(name):
        raise OptionError(f"'{name}' cannot name a voice: use letters, digits, - and _ (starting with a letter "
                          "or digit, at most 64)")
    return name


class VoiceExists(VoiceError):
    """A name already taken by a saved voice (replacing it needs `force`)."""

    def __init__(self, name: str):
        super().__init__(f"a voice named '{name}' is saved already: add --force to replace it")
        self.name = name


@dataclass(frozen=True)
class SavedVoice:
    name: str
    path: Path
    seconds: float
    added: datetime.datetime | None  # (None: a file put there by hand, without the date string)
    source: str  # what it was made from, as given when it was added ("" if unknown)


class VoiceStore:
    """The saved voices in `root` (default: `default_dir()`), read afresh at every call."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_dir()

    def path(self, name: str) -> Path:
        return self.root / f"{check_name(name)}{SUFFIX}"

    def has(self, name: str) -> bool:
        """Whether `name` is a saved voice (False for any string that cannot be a name)."""
        return is_name(name) and (self.root / f"{name}{SUFFIX}").is_file()

    def names(self) -> list[str]:
        try:
            files = [p for p in self.root.iterdir() if p.suffix == SUFFIX and p.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(p.stem for p in files if is_name(p.stem))

    def get(self, name: str) -> SavedVoice:
        """A saved voice's description (its file's header and strings, not its samples)."""
        import soundfile as sf

        path = self._existing(name)
        try:
            with sf.SoundFile(path) as f:
                seconds, date, comment = f.frames / f.samplerate, f.date, f.comment
        except (sf.SoundFileError, RuntimeError, OSError) as e:
            raise VoiceError(f"saved voice '{name}': cannot read {path} ({e})") from None
        try:
            added = datetime.datetime.fromisoformat(date) if date else None
        except ValueError:
            added = None
        return SavedVoice(name, path, seconds, added, comment.removeprefix("minicpm voice from ") if comment else "")

    def list(self) -> list[SavedVoice]:
        return [self.get(name) for name in self.names()]

    def load(self, name: str) -> Voice:
        """The saved samples (checked as any reference is), named for messages."""
        path = self._existing(name)
        return Voice(load_reference(path, name=f"saved voice '{name}' ({path})"), name=f"voice '{name}'")

    def add(self, name: str, source: str | os.PathLike | BinaryIO, *, force: bool = False,
            source_name: str | None = None) -> SavedVoice:
        """Read and check the recording `source` (a path or a binary file), then save its samples as
        `name`. Nothing is written if the recording is refused or the name is taken without `force`."""
        check_name(name)
        if not force:
            self._free(name)
        label = source_name or (os.fspath(source) if not hasattr(source, "read") else getattr(source, "name", ""))
        voice = Voice(load_reference(source, name=label or None))
        piped = not (source_name or hasattr(source, "read") or os.path.isfile(source))  # (/dev/fd/63 names nothing)
        return self.save(name, voice, force=force, source_name=Path(label).name if label and not piped else "")

    def save(self, name: str, voice: Voice, *, force: bool = False, source_name: str = "") -> SavedVoice:
        """Save checked samples as `name`: a temporary file in the directory, renamed into place (with
        `force`), or linked there only if the name is free (without)."""
        import soundfile as sf

        path = self.path(name)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.root)
        except OSError as e:
            raise VoiceError(f"cannot write in the voices folder {self.root}: {e.strerror or e}") from None
        os.close(fd)
        try:
            with sf.SoundFile(tmp, "w", samplerate=SAMPLE_RATE, channels=1, format="WAV", subtype="FLOAT") as f:
                f.date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                if source_name:
                    f.comment = f"minicpm voice from {source_name}"
                f.write(voice.samples)
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
            os.chmod(tmp, new_file_mode())  # (mkstemp's 0600 otherwise: a voice is a file like any other)
            if force:
                os.replace(tmp, path)
            else:
                self._link(tmp, path, name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return self.get(name)

    def remove(self, name: str) -> None:
        path = self._existing(check_name(name))  # (a string that cannot be a name is the caller's mistake)
        try:
            path.unlink()
        except FileNotFoundError:
            raise self._unknown(name) from None

    # -- helpers -------------------------------------------------------------------------------

    def _existing(self, name: str) -> Path:
        if not self.has(name):
            raise self._unknown(name)
        return self.root / f"{name}{SUFFIX}"

    def _unknown(self, name: str) -> VoiceError:
        names = self.names()
        known = f"saved voices: {', '.join(names)}" if names else f"no voices are saved in {self.root}"
        return VoiceError(f"no saved voice '{name}' ({known})")

    def _free(self, name: str) -> None:
        if self.has(name):
            raise VoiceExists(name)

    def _link(self, tmp: str, path: Path, name: str) -> None:
        """Put `tmp` at `path` only if nothing is there (a hard link fails if the name exists, even when
        another process took it a moment ago); where links are not supported, check, then rename."""
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise VoiceExists(name) from None
        except OSError:
            self._free(name)
            os.replace(tmp, path)


class UnknownVoice(VoiceError):
    """A voice reference that names no file (where files are taken) and no voice."""


def locate(ref: str, store: VoiceStore | None = None, *, files: bool = True, openai_names: bool = False,
           base: str | os.PathLike | None = None) -> Path | None:
    """The one rule for what a voice reference names, as a file to read (None: the model's own voice):
    with `files`, an existing file (relative paths from `base`, else the working directory); else
    `default`; else a saved voice (its file); with `openai_names`, one of OpenAI's built-in names,
    which speak the model's own voice; else UnknownVoice. `say`/`reply --voice`, the server's `voice`
    field (names only, OpenAI's too) and `bulk`'s voice column all resolve through here."""
    if not ref.strip():
        raise UnknownVoice("an empty voice: give a recording's path, a saved voice's name, or 'default'")
    if files:
        path = Path(ref).expanduser()
        if base is not None:
            path = Path(base) / path
        if path.exists():  # (a pipe's name, `<(...)`, kept: resolving it names no file)
            return path.resolve() if path.is_file() else path.absolute()
    if ref == DEFAULT_VOICE:
        return None
    store = store or VoiceStore()
    if store.has(ref):
        return store.path(ref)
    if openai_names and ref in OPENAI_VOICES:
        return None
    names = store.names()
    saved = f"saved voices: {', '.join(names)}" if names else "no voices are saved (minicpm voice add NAME FILE)"
    if files:
        raise UnknownVoice(f"{ref}: no such file, and no saved voice has that name ({saved})")
    raise UnknownVoice(f"unknown voice '{ref}' ({saved}; '{DEFAULT_VOICE}' is the model's own voice"
                       + (", as are OpenAI's names unless a saved voice has the name)" if openai_names else ")"))


def resolve(ref: str, store: VoiceStore | None = None, *, files: bool = True, openai_names: bool = False,
            base: str | os.PathLike | None = None) -> Voice | None:
    """The voice `ref` names (`locate`'s rule), read and checked; None for the model's own."""
    store = store or VoiceStore()
    path = locate(ref, store, files=files, openai_names=openai_names, base=base)
    if path is None:
        return None
    if is_name(ref) and path == store.path(ref):
        return store.load(ref)  # (named in messages as the saved voice it is)
    return Voice.load(path)
