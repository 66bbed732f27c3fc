"""Text work of the frontend: tokenizer and chat templates, incremental detokenizing, reasoning
sections, tool-call parsers, structured-output grammars, fill-in-the-middle."""
