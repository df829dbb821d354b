"""prefixgate's HTTP face: the OpenAI API over aiohttp on uvloop."""
