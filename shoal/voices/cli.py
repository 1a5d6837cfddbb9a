"""``shoal voices``: manage the voice library a server uses (``--voices-dir``).

    shoal voices add NAME --audio a.wav --text "..." [--audio b.wav --text "..."]...
                     [--id ID] [--description D] [--tag T]... [--visibility public|unlist|private]
                     [--cover IMG] [--checkpoint DIR] [--device auto]
    shoal voices list [--json]
    shoal voices show ID [--json]
    shoal voices rm ID...

Every subcommand takes ``--voices-dir DIR`` (default ``$SHOAL_VOICES`` or
``~/.local/share/shoal/voices``, the same as ``shoal serve``). ``add`` encodes the samples
with the checkpoint's codec (default: the embedded demo model); a server whose codec differs
re-encodes them once from the stored audio. The server may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .store import VISIBILITIES, Voice, VoiceStore, default_voices_dir


def _dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--voices-dir", default=None, metavar="DIR",
                   help="voice library folder (default: $SHOAL_VOICES or ~/.local/share/shoal/voices)")


def add_voices_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("voices", help="manage the voice library (reference_id / Fish /model)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="voices_cmd", required=True)

    add = sub.add_parser("add", help="add a voice from audio samples and their transcripts")
    add.add_argument("name", help="the voice's title")
    add.add_argument("--audio", action="append", default=[], required=True, metavar="FILE",
                     help="a sample (wav, flac, ogg, mp3 or m4a); repeatable, one --text each")
    add.add_argument("--text", action="append", default=[], metavar="TEXT",
                     help="the transcript of each --audio, in the same order")
    add.add_argument("--id", dest="voice_id", default=None,
                     help="the voice id (default: 32 random hex digits); letters, digits, '_', '-'")
    add.add_argument("--description", default="")
    add.add_argument("--tag", action="append", default=[], help="a tag (repeatable)")
    add.add_argument("--visibility", default="public", choices=VISIBILITIES)
    add.add_argument("--cover", metavar="IMAGE", help="cover image (png, jpeg, gif or webp)")
    add.add_argument("--checkpoint", help="checkpoint whose codec encodes the samples "
                                          "(default: the embedded tiny demo model)")
    add.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    _dir_arg(add)
    add.set_defaults(func=cmd_add)

    ls = sub.add_parser("list", help="list the voices")
    ls.add_argument("--json", action="store_true", help="print JSON")
    _dir_arg(ls)
    ls.set_defaults(func=cmd_list)

    show = sub.add_parser("show", help="show one voice")
    show.add_argument("voice_id", metavar="ID")
    show.add_argument("--json", action="store_true", help="print JSON")
    _dir_arg(show)
    show.set_defaults(func=cmd_show)

    rm = sub.add_parser("rm", help="delete voices")
    rm.add_argument("voice_ids", nargs="+", metavar="ID")
    _dir_arg(rm)
    rm.set_defaults(func=cmd_rm)
    return p


def _root(args: argparse.Namespace) -> Path:
    return Path(args.voices_dir).expanduser() if args.voices_dir else default_voices_dir()


def _as_dict(v: Voice) -> dict:
    return {
        "id": v.id, "title": v.title, "description": v.description, "visibility": v.visibility,
        "tags": list(v.tags), "languages": list(v.languages), "author": v.author_id,
        "created_at": v.created_at, "updated_at": v.updated_at, "task_count": v.task_count,
        "cover": v.cover, "samples": [{"id": s.id, "text": s.text, "format": s.format, "bytes": s.size,
                                       "seconds": s.duration} for s in v.samples],
    }


def cmd_add(args: argparse.Namespace) -> int:
    from .store import SampleInput, validate_voice_id

    if len(args.audio) != len(args.text):
        raise ValueError(f"got {len(args.audio)} --audio but {len(args.text)} --text; give one transcript "
                         "per sample (this tool has no ASR)")
    if args.voice_id is not None:
        validate_voice_id(args.voice_id)  # fail before loading the codec
    samples = [SampleInput(Path(a).read_bytes(), t, title=Path(a).name) for a, t in zip(args.audio, args.text)]
    cover = Path(args.cover).read_bytes() if args.cover else None

    from ..checkpoint import codec_path, resolve_device
    from ..codec import load_codec
    from .codec import codec_encoder, codec_fingerprint

    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
    else:
        from ..demo import default_checkpoint

        checkpoint = default_checkpoint()
    codec = load_codec(codec_path(checkpoint), device=resolve_device(args.device))
    with VoiceStore(_root(args), encoder=codec_encoder(codec), codec_key=codec_fingerprint(codec),
                    sample_rate=codec.sample_rate) as store:
        voice = store.create(title=args.name, samples=samples, voice_id=args.voice_id,
                             description=args.description, visibility=args.visibility, tags=args.tag,
                             cover_image=cover)
    seconds = sum(s.duration for s in voice.samples)
    print(voice.id)
    print(f"added voice {voice.title!r} ({len(voice.samples)} sample(s), {seconds:.1f} s) to {store.root}; "
          f"use it as reference_id={voice.id}", file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with VoiceStore(_root(args)) as store:
        voices, page = [], 1
        while True:
            total, items = store.list(page_size=100, page_number=page, sort_by="created_at")
            voices += items
            if len(voices) >= total or not items:
                break
            page += 1
    if args.json:
        print(json.dumps([_as_dict(v) for v in voices], indent=2, ensure_ascii=False))
        return 0
    if not voices:
        print(f"no voices in {store.root}", file=sys.stderr)
        return 0
    width = max(len(v.id) for v in voices)
    print(f"{'ID':<{width}}  {'SAMPLES':>7}  {'SECONDS':>7}  {'USES':>5}  {'CREATED':<20}  TITLE")
    for v in voices:
        seconds = sum(s.duration for s in v.samples)
        tags = f"  [{', '.join(v.tags)}]" if v.tags else ""
        print(f"{v.id:<{width}}  {len(v.samples):>7}  {seconds:>7.1f}  {v.task_count:>5}  {v.created_at[:19]:<20}  "
              f"{v.title}{tags}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with VoiceStore(_root(args)) as store:
        voice = store.get(args.voice_id)
    d = _as_dict(voice)
    if args.json:
        print(json.dumps(d, indent=2, ensure_ascii=False))
        return 0
    for key in ("id", "title", "description", "visibility", "tags", "languages", "author", "created_at",
                "updated_at", "task_count", "cover"):
        value = d[key]
        print(f"{key + ':':<13} {', '.join(value) if isinstance(value, list) else value}")
    for i, s in enumerate(d["samples"]):
        print(f"sample {i}:     {s['format']}, {s['seconds']:.2f} s, {s['bytes']} bytes: {s['text']}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with VoiceStore(_root(args)) as store:
        for vid in args.voice_ids:
            voice = store.delete(vid)
            print(f"deleted voice {voice.id} ({voice.title!r})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m shoal.voices.cli add|list|show|rm ...`` (the same as ``shoal voices ...``)."""
    from ..cli import main as shoal_main

    return shoal_main(["voices", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
