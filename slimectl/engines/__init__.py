"""Inference engines that speak SGLang's HTTP protocol: the embedded CPU engine, the SGLang launcher, the client."""
