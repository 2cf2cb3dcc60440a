"""Lua scripts of the queue, one file per operation (shipped as package data: tokq.lua)."""
