"""What a relayr home's SQLite database holds, read whole and read-only: for the tests that
check a refused or declined run task wrote nothing in artifactr, reflexr or the ledger."""

import sqlite3
from pathlib import Path
from typing import Any

from relayr.settings import Settings


def database_file(settings_: Settings) -> Path:
    return Path(settings_.database_url.partition(":///")[2])


def table_rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, read-only, in a stable order."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        tables = [
            name
            for (name,) in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        return {
            table: sorted(connection.execute(f'SELECT * FROM "{table}"'), key=repr)
            for table in tables
        }
