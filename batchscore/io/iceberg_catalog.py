"""Iceberg catalogs and tables as a job names them (`output.table`, `input`): `catalog: {name,
...properties}` is what pyiceberg's `load_catalog(name, **properties)` takes (a local SQL catalog:
`type: sql`, `uri: sqlite:///…/catalog.db`, `warehouse: file:///…/warehouse`; a REST, Glue or Hive
catalog by its own properties; a name alone reads ~/.pyiceberg.yaml and PYICEBERG_CATALOG__*), and
`identifier: namespace.table` names the table in it. Errors name the job key they came from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_iceberg_catalog(catalog: dict[str, Any], key: str, error: type[Exception]):
    """The catalog `catalog` describes; raises `error` naming `key` (`output.table.catalog`,
    `input.catalog`) when pyiceberg is missing or the catalog cannot be opened."""
    try:
        from pyiceberg.catalog import load_catalog
    except ImportError as exc:
        raise error(f"{key}: Iceberg tables need the pyiceberg package "
                    f"(pip install 'batchscore[iceberg]'): {exc}") from None
    name = str(catalog.get("name") or "default")
    properties = {k: str(v) for k, v in catalog.items() if k != "name"}
    try:
        return load_catalog(name, **properties)
    except Exception as exc:  # noqa: BLE001 - each catalog kind raises its own (sqlalchemy, HTTP, boto)
        raise error(f"{key}: cannot open the Iceberg catalog {name!r} ({_shown(properties)}): {exc}") from None


def load_iceberg_table(catalog, identifier: str, key: str, error: type[Exception]):
    """The table `identifier` of `catalog`, or None when the catalog has no such table (or
    namespace); raises `error` naming `key` for any other failure."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        return catalog.load_table(identifier)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None
    except Exception as exc:  # noqa: BLE001 - a catalog's own refusal (a bad identifier, a store error)
        raise error(f"{key}: cannot load the Iceberg table {identifier!r}: {exc}") from None


def catalog_relative_to(catalog: dict[str, Any], base: Path) -> dict[str, Any]:
    """`catalog` with a local warehouse folder and a SQLite file given relative to the job file made
    absolute (`base`: its folder), as the job's other paths are; URLs and absolute paths stay."""
    resolved = dict(catalog)
    warehouse = resolved.get("warehouse")
    if isinstance(warehouse, str) and warehouse and "://" not in warehouse and not os.path.isabs(warehouse):
        resolved["warehouse"] = os.path.abspath(base / os.path.expanduser(warehouse))
    uri = resolved.get("uri")
    if isinstance(uri, str) and uri.startswith(_SQLITE) and not uri[len(_SQLITE):].startswith("/") \
            and uri[len(_SQLITE):] not in ("", ":memory:"):
        resolved["uri"] = _SQLITE + os.path.abspath(base / uri[len(_SQLITE):])  # sqlite:////abs/catalog.db
    return resolved


_SQLITE = "sqlite:///"  # SQLAlchemy's: a relative file after three slashes, an absolute one after four


def make_local_folders(catalog: dict[str, Any]) -> None:
    """The folders of a local SQL catalog (its SQLite file's, its warehouse) made, as an output's
    folder is: the first night makes the catalog and its table where the job says."""
    uri, warehouse = catalog.get("uri"), catalog.get("warehouse")
    if isinstance(uri, str) and uri.startswith(_SQLITE) and uri[len(_SQLITE):] not in ("", ":memory:"):
        Path(uri[len(_SQLITE):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
    if isinstance(warehouse, str) and warehouse and ("://" not in warehouse or warehouse.startswith("file://")):
        Path(warehouse.removeprefix("file://")).expanduser().mkdir(parents=True, exist_ok=True)


def identifier_problems(identifier: str | None, key: str) -> list[str]:
    """What is wrong with an identifier a job gives (`key`: where), for the job file's checks."""
    if not identifier:
        return [f"{key}: the Iceberg table's identifier in its catalog, e.g. nightly.scores (namespace.table)"]
    if "." not in identifier.strip(".") or any(not part for part in identifier.split(".")):
        return [f"{key}: {identifier!r} is not namespace.table (e.g. nightly.scores)"]
    return []


def table_name_problems(section: str, catalog, identifier: str | None, path: str | None) -> list[str]:
    """What a job's Iceberg table (`section`: "input" or "output.table") lacks to be named: a catalog
    and an identifier, and no path, for the job file's checks."""
    problems = identifier_problems(identifier, f"{section}.identifier")
    if not catalog:
        problems.append(f"{section}.catalog: the Iceberg catalog the table is in, as pyiceberg's load_catalog "
                        "takes it, e.g. {name: local, type: sql, uri: 'sqlite:///…/catalog.db', warehouse: "
                        "'file:///…/warehouse'}")
    if path:
        problems.append(f"{section}.path: an Iceberg table is named by {section}.catalog and {section}.identifier, "
                        "not a path")
    return problems


_SECRET_WORDS = ("secret", "password", "token", "credential", "key")


def _shown(properties: dict[str, str]) -> str:
    """The catalog's properties for a message, with secrets left out."""
    return ", ".join(f"{k}={'***' if any(w in k.lower() for w in _SECRET_WORDS) else v}"
                     for k, v in properties.items()) or "no properties"
