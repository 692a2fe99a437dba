"""Command-line entry points: the only place that parses arguments. One module per subcommand."""
