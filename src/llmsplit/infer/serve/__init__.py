"""The server's room: HTTP only (OpenAI routes, protocol, replies, edge middleware, metrics,
template time limits) and the engine thread, which alone drives the engine through
submit / abort / stats. Start reading at server.py."""
