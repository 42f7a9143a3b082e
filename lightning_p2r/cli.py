"""The ``lightning-p2r`` command: a LightningCLI over :class:`M6LanguageModel` and :class:`TextDataModule`."""

from __future__ import annotations

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from .data import TextDataModule
from .module import M6LanguageModel

# The dataclass fields' docstrings become --help text and YAML comments.
set_parsing_settings(docstring_parse_attribute_docstrings=True)


class P2RCLI(LightningCLI):
    """LightningCLI with the data module's vocabulary size linked into the model config."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The embedding must cover every id the tokenizer emits; linking removes the chance to set them apart.
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.config.max_seq_len", apply_on="parse")

    def instantiate_classes(self) -> None:
        # A bad value that only the class can judge (a range, a divisibility, a missing corpus) ends the command
        # with the usual one-line CLI error instead of a traceback, before anything is trained or written.
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as error:
            self.parser.error(str(error))


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-p2r {fit,validate,test,predict}``. Returns nothing: the console script passes the
    return value to ``sys.exit``, which would turn an object into exit status 1."""
    P2RCLI(
        M6LanguageModel,
        TextDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
