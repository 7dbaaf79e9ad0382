"""Reading a YAML configuration file (a price list, a models file) with errors that name the file and what it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: str | Path, what: str, error: type[Exception]) -> Any:
    """The file's YAML document; `error` names the file and `what` it should be when it cannot be read or parsed."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML ({e})") from None
