"""The voice library: named voices (audio samples + transcripts, codes encoded once) stored in a
folder, served as Fish Audio's ``/model`` and selected by ``reference_id`` / OpenAI ``voice``.

See ``docs/voices.md``; the pieces are :class:`~shoal.voices.store.VoiceStore` (storage),
``shoal.server.voices_api`` (HTTP) and ``shoal voices`` (:mod:`shoal.voices.cli`).
"""

from .errors import Forbidden, InvalidVoice, TooLarge, UnsupportedMedia, VoiceExists, VoiceNotFound, VoiceStoreError
from .store import (
    LOCAL_AUTHOR,
    SCHEMA_VERSION,
    VOICE_ID_RE,
    Sample,
    SampleInput,
    StoreLimits,
    Voice,
    VoiceStore,
    default_voices_dir,
    guess_language,
    validate_voice_id,
)

__all__ = [
    "LOCAL_AUTHOR", "SCHEMA_VERSION", "VOICE_ID_RE", "Forbidden", "InvalidVoice", "Sample", "SampleInput",
    "StoreLimits", "TooLarge", "UnsupportedMedia", "Voice", "VoiceExists", "VoiceNotFound", "VoiceStore",
    "VoiceStoreError", "default_voices_dir", "guess_language", "validate_voice_id",
]
