"""Voice-store errors; each carries the HTTP status the server answers with.

They subclass :class:`ValueError`, so ``shoal voices ...`` prints them as ``shoal: error: ...``.
"""

from __future__ import annotations


class VoiceStoreError(ValueError):
    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = int(status)


class InvalidVoice(VoiceStoreError):
    """Bad input: a malformed id, a missing transcript, a too-short sample (400)."""

    status = 400


class Forbidden(VoiceStoreError):
    """The caller may not change this voice (403)."""

    status = 403


class VoiceNotFound(VoiceStoreError, LookupError):
    status = 404


class VoiceExists(VoiceStoreError):
    status = 409


class TooLarge(VoiceStoreError):
    """An upload over a size cap (413)."""

    status = 413


class UnsupportedMedia(VoiceStoreError):
    """Bytes that are not a supported audio / image format, whatever their name says (415)."""

    status = 415
