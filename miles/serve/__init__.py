"""`miles serve`: an engine behind HTTP (SGLang's native API and the OpenAI API)."""
