"""What ops read and do to runs, shared by the command line and the console."""
