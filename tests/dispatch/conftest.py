"""The dispatcher's tests share a harness on every storage (in memory, SQLite, PostgreSQL)."""

from tests.dispatch.dispatch_harness import database_url as database_url
from tests.dispatch.dispatch_harness import harness as harness
