"""shoal: a high-throughput inference server for Fish Speech DualAR TTS models."""

__version__ = "0.1.0"
