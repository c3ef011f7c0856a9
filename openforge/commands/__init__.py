"""One module per `openforge` subcommand; each exposes `register(app)` and imports heavy things lazily."""
