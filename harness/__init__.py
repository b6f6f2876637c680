"""Agent scaffolds: tools, prompts, context management, skills, memories, subagents."""
