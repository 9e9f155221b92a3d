"""The GPU check's GRPO reward: a cheap function of the completion text (the share of its words that start with a
vowel, plus a little for length up to 20 words), so the step time is the policy's, not the reward's."""


def reward(prompts, completions, *_):
    out = []
    for text in completions:
        words = text.split()
        vowels = sum(1 for w in words if w[:1].lower() in "aeiou")
        out.append(vowels / max(1, len(words)) + min(len(words), 20) / 40)
    return out
