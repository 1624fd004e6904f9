"""The prompts of ``quill bench spec``: copy-heavy requests (rewrite, edit, summarise or repeat a given passage
or code file, whose answers quote their prompt) and free chat (answers the prompt does not contain).

Each is one user message; the first copy-heavy prompts copy the most (``--prompts N`` keeps the first N).
"""

from __future__ import annotations

_RIVER = (
    "The river rises in a wet meadow high in the hills, where three small springs meet beneath a row of old "
    "willows. For the first few miles it is narrow enough to jump across, and it runs quickly over smooth grey "
    "stones. Below the village of Ashford it slows down and widens, turning the wheel of a mill that has ground "
    "flour for more than four hundred years. Farmers along its banks still remember the winter of the great "
    "flood, when the water reached the church steps and the bridge was closed for a month. Today the river is "
    "home to otters, herons and brown trout, and on summer evenings children swim in the deep pool under the "
    "bridge while their parents sit on the warm stones and talk.")

_TYPOS = (
    "Last sumer our famly drove to the coast for a weeks holliday. We stayed in a smal cottage near the harbour, "
    "and every morning we walked along the beech to buy fresh bread from the bakery. My yunger brother colected "
    "shells and stones, wich he kept in a bucket by the door untill it was to heavy to lift. On the thrid day it "
    "rained so hard that we could not go outside, so we played cards and read books by the fire. My father "
    "tryed to cook fish for dinner but he burnt it, and we had to eat sandwitches instead. On the last evening "
    "we climed the hill behind the village to watch the sun go down over the see. It was the most beutiful "
    "thing I have ever seen, and I hope we can go back there next year.")

_TOWN = (
    "The town council met on Tuesday evening to discuss the future of the old railway station, which has stood "
    "empty since the line closed in 1998. Several members argued that the building should be turned into a "
    "library and community centre, pointing out that the current library is too small and has no space for "
    "children's activities. Others wanted to sell the site to a developer who has offered to build forty new "
    "homes there, saying that the town badly needs more housing and that the money could pay for repairs to "
    "the swimming pool. After two hours of debate the council agreed to ask residents for their views before "
    "making a decision. A public meeting will be held in the station itself next month, and a short survey "
    "will be sent to every household in the town.")

_PRESENT = (
    "Maria wakes up at six o'clock every morning and opens the window to check the weather. She makes a cup of "
    "strong coffee and eats a slice of toast with honey while she reads the news. At seven she cycles to the "
    "hospital, where she works as a nurse in the children's ward. The ward is busy, and she spends most of the "
    "day checking on her patients, giving them their medicine and talking with their worried parents. At lunch "
    "she sits in the garden with her friend Tom, who works in the kitchen. In the evening she cycles home, "
    "cooks a simple dinner and calls her sister. Before she goes to bed she reads a few pages of a novel.")

_EMAIL = (
    "Dear Mr Patel,\n\nThank you for you're letter of the 3rd of May. I am writing to let you knows that the "
    "order you placed have been delayed, because our supplier were unable to deliver the parts on time. We "
    "expects the goods to arrive at our warehouse next week, and we will sends them to you as soon as they "
    "arrives. I am very sorry for any inconvenience this may causes. If you would prefer to cancel the order, "
    "please let me knows and we will refund the full amount. Otherwise, there are no need to do anything.\n\n"
    "Your sincerely,\nAnna Lewis\nCustomer Service")

_FUNCTION = '''def summarize_orders(orders, min_total=0, currency="EUR"):
    totals = {}
    for order in orders:
        if order["currency"] != currency:
            continue
        customer = order["customer"]
        totals[customer] = totals.get(customer, 0) + order["amount"]
    result = []
    for customer, total in totals.items():
        if total >= min_total:
            result.append((customer, round(total, 2)))
    result.sort(key=lambda item: item[1], reverse=True)
    return result'''

_RENAME = '''def load_scores(path):
    data = []
    with open(path) as f:
        for line in f:
            name, score = line.strip().split(",")
            data.append({"name": name, "score": int(score)})
    return data


def best_scores(path, count=3):
    data = load_scores(path)
    data.sort(key=lambda row: row["score"], reverse=True)
    return [row["name"] for row in data[:count]]'''

_CLASS = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        self.items[name] = self.items.get(name, 0) + quantity

    def remove(self, name, quantity):
        if self.items.get(name, 0) < quantity:
            raise ValueError(f"not enough {name}")
        self.items[name] -= quantity

    def count(self, name):
        return self.items.get(name, 0)'''

COPY = (
    f"Repeat the following text exactly, word for word:\n\n{_RIVER}",
    f"Rewrite the following paragraph, correcting the spelling mistakes. Change nothing else.\n\n{_TYPOS}",
    f"Here is a Python function. Add type hints to it and return the whole function.\n\n```python\n{_FUNCTION}\n```",
    "Edit this Python code: rename the variable `data` to `records` everywhere and return the whole code.\n\n"
    f"```python\n{_RENAME}\n```",
    f"Rewrite the following paragraph in the past tense:\n\n{_PRESENT}",
    f"Fix the grammar mistakes in this email and return the corrected email:\n\n{_EMAIL}",
    "Add a short docstring to each method of this Python class and return the whole class.\n\n"
    f"```python\n{_CLASS}\n```",
    f"Summarise the following passage in three sentences, reusing its wording:\n\n{_TOWN}",
)

CHAT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What are some good tips for learning a new language as an adult?",
    "Write a poem about the first snow of winter.",
    "How does a bicycle stay upright when it is moving?",
    "What is the difference between weather and climate?",
    "Describe a day in the life of a baker in a medieval village.",
    "Why is the sky blue? Explain it simply.",
)

SETS = {"copy": COPY, "chat": CHAT}
