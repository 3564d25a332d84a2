"""Agentic RL: multi-turn rollouts in which the policy calls tools or is driven by an agent.

Three ways in, one trajectory format (`miles.data.trajectory`): built-in tool calling
(`--tool-path`), a custom generate function (`--custom-generate-function-path`) and a black-box
agent over an OpenAI-compatible API (`--agent-path`). See docs/agents.md.
"""
