"""Recipe files as a user sees them: errors name the file and the line.

jsonargparse parses a recipe from a string, so a YAML syntax error says ``"<unicode string>", line 3`` and an
unknown or bad key gives only its dotted name. These pure functions read the recipe files themselves: the syntax is
checked before the CLI starts, and a key the parser names is found in the file it came from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

import yaml

_CONFIG_FLAGS = ("--config", "-c")


def recipe_paths(argv: Sequence[str]) -> list[str]:
    """The files given with ``--config``/``-c`` (``--config=FILE`` too), in order; later ones override earlier."""
    paths = []
    for index, word in enumerate(argv):
        if word in _CONFIG_FLAGS and index + 1 < len(argv):
            paths.append(argv[index + 1])
        elif word.startswith("--config="):
            paths.append(word.split("=", 1)[1])
    return paths


def check_recipe_files(paths: Iterable[str]) -> str | None:
    """The first problem with the recipe files, as one line naming the file (and line, column), or None.

    A value that is itself YAML (``--config='{trainer: ...}'``, which jsonargparse accepts) is not a path: it is
    left to the parser."""
    for path in paths:
        if not os.path.exists(path):
            if path.lstrip().startswith(("{", "[")) or "\n" in path:
                continue
            return f"recipe {path} does not exist (the recipes that ship are in recipes/*.yaml)"
        if os.path.isdir(path):
            return f"recipe {path} is a folder: pass a .yaml file"
        try:
            with open(path, encoding="utf-8") as file:
                content = yaml.safe_load(file)
        except UnicodeDecodeError as error:
            return f"recipe {path} is not UTF-8 text ({error.reason} at byte {error.start})"
        except yaml.YAMLError as error:
            return f"recipe {path}: {_describe_yaml_error(error)}"
        if content is not None and not isinstance(content, dict):
            return (f"recipe {path}: a recipe maps sections to options (trainer:, model:, data:, ...), got a "
                    f"{type(content).__name__} at the top level")
    return None


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def locate_key(paths: Sequence[str], dotted: str) -> str | None:
    """``"FILE, line N"`` for the last recipe among ``paths`` that sets ``dotted`` (``model.config.num_layers``;
    ``init_args`` levels are looked through, as the parser names keys without them), or None."""
    found = None
    for path in paths:
        try:
            with open(path, encoding="utf-8") as file:
                root = yaml.compose(file)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        line = _find(root, dotted.split("."))
        if line is not None:
            found = f"{path}, line {line}"
    return found


def _find(node: yaml.Node | None, keys: list[str]) -> int | None:
    if not keys or not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if key_node.value == keys[0]:
            if len(keys) == 1:
                return key_node.start_mark.line + 1
            return _find(_through_init_args(value_node), keys[1:])
    return None


def _through_init_args(node: yaml.Node) -> yaml.Node:
    """``strategy: {class_path: ..., init_args: {sharding: ...}}`` is addressed as ``strategy.sharding``."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.value == "init_args":
                return value_node
    return node


def keys_named_in(message: str) -> list[str]:
    """The dotted keys a (condensed) parser error names, most specific first: ``trainer.strategy: option 'x' is not
    accepted`` -> ``trainer.strategy.x``; ``trainer.strategy.sharding: expected ...`` -> that key; ``does not accept
    option 'model.config.x'`` -> that key; then any ``Parser key "..."``."""
    keys = [f"{prefix}.{name}" for prefix, name in re.findall(r"([\w.]+): option '(\w+)' is not accepted", message)]
    keys += re.findall(r"^([\w.]+):\s", message)
    keys += re.findall(r"option '([\w.]+)'", message)
    keys += re.findall(r'Parser key "([\w.]+)"', message)
    return list(dict.fromkeys(keys))


def names_model_class(argv: Sequence[str]) -> bool:
    """Whether the command line or a recipe picks the model's class (``model: class_path: ...``, as a recipe for
    ``CausalLMModule`` does), rather than configuring the default ``M6LanguageModel``."""
    if any(word.startswith(("--model.class_path", "--model=")) or word == "--model" for word in argv):
        return True
    for path in recipe_paths(argv):
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as file:
            recipe = yaml.safe_load(file)
        for section in (recipe or {}, *(v for v in (recipe or {}).values() if isinstance(v, dict))):
            model = section.get("model") if isinstance(section, dict) else None
            if isinstance(model, dict) and "class_path" in model:
                return True
    return False
