"""What one process runs with: its application, its runtime on one event loop, its supervisor."""
