"""Tests of one process's runtime: settings, the application, storage, the supervisor."""
