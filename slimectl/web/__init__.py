"""HTTP plumbing shared by the library: aiohttp server helpers, the sync JSON client, the one HTTP error type, retries."""
