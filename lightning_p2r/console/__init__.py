"""What the package prints and what it keeps quiet: aligned plain-text tables (``text_table``, for the CLI, the
benchmarks and per-language metrics) and the third-party warnings a run silences or allows (``known_warnings``,
each with its reason). Neither imports torch or Lightning."""
