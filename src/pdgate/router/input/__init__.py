"""Client input: request schema, bounds on hostile input, the chat-template sandbox and
its workers, tokenization."""
