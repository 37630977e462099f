"""The transformers versions quest-hf supports, checked when quest_hf is imported."""
from __future__ import annotations

MIN_TRANSFORMERS = (5, 17)  # pyproject.toml: transformers>=5.17,<6


def check_transformers(version: str | None = None) -> None:
    """Raise ImportError, with what to install, when `version` (default: the installed transformers) is older than
    the oldest supported one: below it the cache layer API differs and generate() would fail with an
    abstract-class TypeError."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        import transformers

        version = transformers.__version__
    try:
        release = Version(version).release
    except InvalidVersion:
        return  # a source build with an odd tag: let it try
    if release[:2] < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"quest-hf needs transformers >= {need} (its Cache layers, attention interface and "
                          f"generate()), found transformers {version}: pip install -U 'transformers>={need},<6'")


check_transformers()
