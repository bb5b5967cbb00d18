"""The wire contract at the bottom of the stack: the generated ``fedatoms.v1`` stubs (``fedwire.v1``),
tensor framing (``fedwire.framing``) and the allocator settings of processes that stream models.

Server, client agent and dashboard import it downward; it imports nothing of theirs.
"""
