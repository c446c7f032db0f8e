"""What people use: the run timeline, terminal output, checks and the pikku CLI."""
