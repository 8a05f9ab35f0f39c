"""The one exception users see: a clear, one-line message (the CLI prints it, no traceback)."""


class KestrelError(Exception):
    """Bad input: missing or corrupt files, unknown architectures, prompts too long, ..."""


class ModelError(KestrelError):
    """The model file is at fault, found at run time (NaN/Inf logits from corrupt weights):
    not the request's fault (the server answers 500, not 400)."""


def clip(value, limit: int = 60) -> str:
    """str(value) on one line, cut to `limit` characters: what an error line may echo of
    input that a hostile file controls (names, shapes, an exception quoting its input)."""
    s = " ".join(str(value).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."
