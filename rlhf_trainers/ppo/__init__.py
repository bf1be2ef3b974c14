"""PPO: value model, GAE, value loss, critic warmup. Built in issue #4; nothing here yet."""
