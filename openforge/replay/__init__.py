"""Replay captured traces: answer a toolchain from a trace (`serve`), or re-send its engine calls (`drive`).

`trace` reads a trace's exchanges (shared by both) · `serve` matches incoming calls to recorded conversations
and answers with the recorded bytes · `drive` re-sends recorded requests to a live engine and measures.
Only the standard library, msgpack (via addons.flowfile) and httpx (drive) are used, so this runs anywhere
the proxy does.
"""
