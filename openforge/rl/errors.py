"""The one error `openforge rl` shows as a message rather than a traceback."""


class RLError(RuntimeError):
    """The run cannot go on (bad input, a stage with nothing for the next); the message says what to do."""
