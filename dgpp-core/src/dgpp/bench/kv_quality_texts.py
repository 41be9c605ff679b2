"""The fixed text set ``dgpp bench kv-quality`` scores: short paragraphs of varied kinds (prose, a recipe, code,
dialogue, numbers and a list, encyclopedic facts, a letter, a poem). Changing a text changes every number measured
with it: add new texts at the end and record the set's commit with each result."""

from __future__ import annotations

TEXTS: tuple[str, ...] = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lamp room he could see the "
    "fishing boats returning, their wakes drawing pale lines across the darkening water, and the gulls settling "
    "on the rocks below. He wound the clockwork, trimmed the wick and wrote the weather in his log before the "
    "first beam swept out over the bay.",
    "To make a simple tomato sauce, warm two tablespoons of olive oil in a wide pan over medium heat. Add a sliced "
    "clove of garlic and cook until it just turns golden. Pour in a can of crushed tomatoes, season with salt, "
    "and let it simmer for twenty minutes, stirring now and then. Finish with a few torn basil leaves.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    '"Are you coming to the station?" asked Maria, pulling on her coat.\n"Only if the train is on time," '
    'said Tom. "Last week I waited an hour in the rain."\n"It was snow, not rain," she laughed, "and you '
    'spent the whole hour in the cafe."',
    "Quarterly results: revenue rose 12 percent to 4.8 million dollars, while operating costs fell from 3.1 to "
    "2.9 million. The company hired 17 engineers, opened offices in Lisbon and Osaka, and expects growth of 8 to "
    "10 percent next year.\n1. Reduce shipping times.\n2. Expand the support team.\n3. Launch the mobile app.",
    "The Danube is the second-longest river in Europe, after the Volga. It rises in the Black Forest in Germany "
    "and flows for about 2,850 kilometres through ten countries, including Austria, Hungary, Serbia and Romania, "
    "before emptying into the Black Sea through a wide delta that is home to hundreds of species of birds.",
    "Dear Ms. Patel,\nThank you for your letter of 3 March. I am pleased to confirm that your order has been "
    "shipped and should arrive within five working days. If anything is missing or damaged, please contact our "
    "service desk and we will replace it at no cost.\nYours sincerely,\nJames Whitfield",
    "The autumn wind goes wandering\nacross the empty field,\nit lifts the leaves like sparrows\nand shows what "
    "summer sealed.\nThe river keeps its counsel,\nthe hills are turning grey,\nand every lamp in the village\n"
    "is lit before the day.",
)
