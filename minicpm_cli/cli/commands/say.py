"""`minicpm say` (read text aloud) and `minicpm reply` (answer a message with speech).

Both take their speech from a speaker (`cli.speaker`: the model here or a running server) and write
it with the same sinks (`audio.open_sink`): a file gets each segment decoded in one piece, stdout and
--raw get chunks as soon as they are generated.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ... import audio, captions as cc, trace
from ...errors import OptionError, UsageError
from ...files import check_target, write_whole
from ..options import (CaptionsOpt, OutputOpt, SpeakerOptions, check_not_voice, check_sampling, check_speed,
                       chunk_frames, output_target, with_speaker_options)
from ..speaker import speaker as find_speaker
from ..streams import arriving, input_lines, play, progress, read_text


@with_speaker_options
def say(
    text: Annotated[Optional[str], typer.Argument(help="Text to speak; read from -f FILE, or from stdin when omitted or -.", show_default=False)] = None,
    output: OutputOpt = None,
    file: Annotated[Optional[str], typer.Option("--file", "-f", help="Read the text from FILE (- for stdin).")] = None,
    lines: Annotated[bool, typer.Option("--lines", help="Speak each input line as soon as it arrives.")] = False,
    directory: Annotated[Optional[str], typer.Option("--dir", "-d", help="With --lines: one file per line in DIR (names printed on stderr).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="With --dir: lines generated at once (a batch on the model here, or concurrent requests to a server); each file is still written whole and named in input order.")] = 1,
    captions: CaptionsOpt = None,
    *,
    opts: SpeakerOptions,
) -> None:
    """Read text aloud: to an audio file, or streamed to stdout as it is generated.

    A file gets each segment decoded in one piece (the reference's read-aloud waveform); stdout and
    --raw get audio chunk by chunk as soon as it is generated. Text on standard input is spoken as it
    arrives, from its first sentence (or clause long enough), until the input ends. A running
    `minicpm serve` does the work when one answers (the same bytes come out); --local loads the
    model here.
    """
    trace.mark("parsed")
    if text == "-":  # (standard input, as -f - and -o - name it)
        text = None
    if captions is not None:
        cc.check_target(captions)
        if directory is not None:
            raise OptionError("--captions writes one file for one stream: for a caption file per line, "
                              "use minicpm bulk --captions")
    frames = chunk_frames(opts.first_chunk)
    speed = check_speed(opts.speed)
    raw, pcm = opts.raw, opts.pcm
    if batch < 1:
        raise OptionError("--batch must be at least 1")
    if batch > 1 and directory is None:
        raise OptionError("--batch reads several lines at once into their own files: use it with --lines --dir")
    if directory is not None:
        if not lines:
            raise OptionError("--dir writes one file per line: use it with --lines")
        if output is not None:
            raise OptionError("give either -o or --dir, not both")
        audio.check_pcm(pcm)
    else:
        output = output_target(output)
        audio.check_output(output, pcm, raw)
        check_not_voice(output, opts.voice)
    if lines and text is not None:
        raise OptionError("--lines reads standard input or -f FILE, not an argument")
    read_lines = input_lines(file) if lines else None  # (opened now: before a directory is made or a model loaded)
    if directory is not None:
        audio.make_directory(directory)
    # standard input is spoken as it arrives (whole when it comes at once: `echo TEXT | minicpm say`)
    arrivals = arriving(file) if not lines and text is None and file in (None, "-") else None
    whole = None if lines or arrivals is not None else read_text(text, file).strip()
    if whole is not None and not whole:
        raise UsageError("no text to speak")

    check_sampling(opts.greedy, opts.seed)
    spk = find_speaker(opts, rows=batch)
    texts = None
    if lines:  # (the first line waited for here, so that input without one is the error it is for an argument)
        texts = (line for line in read_lines if line.strip())
        first = next(texts, None)
        if first is None:
            raise UsageError("no text to speak")
        texts = itertools.chain([first], texts)
    timeline = cc.Timeline()
    bar = progress()
    advance = (lambda c: bar.update(len(c.samples) / c.sample_rate)) if bar is not None else None
    # a file gets each segment decoded in one piece; stdout, a pipe, a device and raw PCM as a stream
    decode = "stream" if raw or (directory is None and audio.is_stream(output)) else "segment"

    def chunks(t: str, decode: str, target: str):
        # (a server sends the sink's own samples when it writes them as they are)
        return spk.read(t, greedy=opts.greedy, seed=opts.seed, decode=decode, first_chunk=frames, speed=speed,
                        pcm=pcm if audio.takes_pcm(target, pcm, raw) else None, timestamps=captions is not None)

    def speak(t: str, target: str) -> None:
        # (the chunks are asked for before the sink is opened: a server starts on them while opening
        # it may load numpy and libsndfile)
        stream = chunks(t, decode, target)
        play(cc.timed(stream, timeline), audio.open_sink(target, pcm, spk.sample_rate, raw), advance)

    try:
        if whole is not None:
            speak(whole, output)
            trace.mark("written")
        elif arrivals is not None:
            stream = spk.read_arriving(arrivals, greedy=opts.greedy, seed=opts.seed, decode=decode,
                                       first_chunk=frames, speed=speed,
                                       pcm=pcm if audio.takes_pcm(output, pcm, raw) else None,
                                       timestamps=captions is not None)
            play(cc.timed(stream, timeline), audio.open_sink(output, pcm, spk.sample_rate, raw), advance)
            trace.mark("written")
        elif directory is not None:
            paths = (str(Path(directory) / f"line-{n:04d}{'.raw' if raw else '.wav'}") for n in itertools.count(1))
            if batch == 1:  # each line's chunks written as they come
                spoken = ((path, chunks(t, decode, path)) for t, path in zip(texts, paths))
            else:
                spoken = zip(paths, spk.read_many(texts, batch=batch, greedy=opts.greedy, seed=opts.seed,
                                                    decode=decode, first_chunk=frames, speed=speed))
            for path, line_chunks in spoken:
                play(line_chunks, audio.open_sink(path, pcm, spk.sample_rate, raw), advance)
                print(path, file=sys.stderr, flush=True)
        else:
            # every line into one stream or file, each line's chunks as soon as they exist
            every = (chunk for line in texts for chunk in chunks(line, decode, output))
            play(cc.timed(every, timeline), audio.open_sink(output, pcm, spk.sample_rate, raw), advance)
        if captions is not None:
            timeline.finish()
            cc.write(captions, timeline.cues, spk.sample_rate)
    finally:
        if bar is not None:
            bar.close()


@with_speaker_options
def reply(
    text: Annotated[Optional[str], typer.Argument(help="The user's message; read from stdin when omitted or -.", show_default=False)] = None,
    output: OutputOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most LLM tokens in the reply.")] = 512,
    text_out: Annotated[Optional[str], typer.Option("--text-out", help="Write the reply text to FILE (- for stdout) instead of stderr.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="LLM sampling temperature [default: 0.7].", show_default=False)] = None,
    captions: CaptionsOpt = None,
    *,
    opts: SpeakerOptions,
) -> None:
    """Answer a message with speech, streamed as the LLM writes the answer.

    The reply text goes to stderr as it is spoken (to stdout with --text-out -, or to --text-out FILE
    when the reply ends); audio goes where `say` would put it.
    """
    if text == "-":  # (standard input)
        text = None
    if captions is not None:
        cc.check_target(captions)
    frames = chunk_frames(opts.first_chunk)
    speed = check_speed(opts.speed)
    output = output_target(output)
    audio.check_output(output, opts.pcm, opts.raw)
    check_not_voice(output, opts.voice)
    if temperature is not None and opts.greedy:
        raise OptionError("--greedy takes no --temperature: greedy decoding draws nothing (give one or the other)")
    if temperature is not None and not 0 < temperature < float("inf"):
        raise OptionError("--temperature must be a positive number (use --greedy for the most likely tokens)")
    temperature = 0.7 if temperature is None else temperature
    if max_tokens < 1:
        raise OptionError("--max-tokens must be at least 1")
    message = read_text(text, None).strip()
    if not message:
        raise UsageError("no text to reply to")
    if text_out == "-" and output == "-":
        raise OptionError("--text-out - and the audio would both go to stdout: write one of them to a file")
    if text_out == "-" and sys.stdout is None:
        raise UsageError("standard output is closed: give --text-out FILE")
    if text_out not in (None, "-"):
        check_target(text_out, "--text-out")

    check_sampling(opts.greedy, opts.seed)
    spk = find_speaker(opts)
    timeline = cc.Timeline()
    said: list[str] = []

    shown = {None: sys.stderr, "-": sys.stdout}.get(text_out)  # (the text as it is spoken; a file's at the end)

    def show(chunk) -> None:
        said.append(chunk.text)
        if shown is not None and chunk.text:
            shown.write(chunk.text)
            shown.flush()

    chunks = spk.reply(message, greedy=opts.greedy, seed=opts.seed, temperature=temperature, max_tokens=max_tokens,
                         first_chunk=frames, speed=speed, pcm=opts.pcm if audio.takes_pcm(output, opts.pcm, opts.raw) else None,
                         timestamps=captions is not None)
    try:
        play(cc.timed(chunks, timeline), audio.open_sink(output, opts.pcm, spk.sample_rate, opts.raw), show)
    except Exception:
        if shown is sys.stderr and "".join(said):  # (the error's line on a line of its own)
            sys.stderr.write("\n")
            sys.stderr.flush()
        raise
    if captions is not None:
        timeline.finish()
        cc.write(captions, timeline.cues, spk.sample_rate)
    if shown is not None:
        shown.write("\n")
        shown.flush()
    else:
        try:
            write_whole(text_out, ("".join(said) + "\n").encode("utf-8"))
        except OSError as e:  # (the audio is written: say what became of the text, in one line)
            raise UsageError(f"cannot write the reply's text to {text_out}: {e.strerror or e} (it was: "
                             f"{''.join(said)!r})") from None
