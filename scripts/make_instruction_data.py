"""Write the instruction set shipped with the package: small chat tasks with exact answers, in three splits.

    .venv/bin/python scripts/make_instruction_data.py            # rewrites nemo_noise_plugin/data/instructions/
    .venv/bin/python scripts/make_instruction_data.py /tmp/out   # the same files into another folder

Deterministic (seeded): running it again gives the same bytes. Each task of
``data.instruction_set.INSTRUCTION_TASKS`` gets ``PER_TASK`` examples with distinct questions (no question
is shared between tasks or splits), split per task into ``test``, ``validation`` and ``training``, then each split
is shuffled. Short-answer tasks answer one number, word or letter; long-answer tasks (spelling, reversing, sorting,
counting a range) answer tens of tokens, so answer length and copying can be measured.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

from nemo_noise_plugin.data.instruction_set import INSTRUCTION_TASKS

SYSTEM = "Reply with the exact answer only."
OUT = Path(__file__).resolve().parent.parent / "nemo_noise_plugin" / "data" / "instructions"
SEED = 20261201
PER_TASK = 480
SPLIT_SIZES = {"test": 40, "validation": 40}
"""Examples per task in the held-out splits; ``training`` gets ``PER_TASK`` minus their sum."""

WORDS = tuple(
    sorted(
        set(
            """
tiger zebra koala dolphin falcon parrot rabbit kitten oyster donkey monkey giraffe elephant penguin octopus
squirrel hamster leopard panther buffalo camel beaver badger weasel otter walrus lobster shrimp salmon sardine
turtle tortoise lizard iguana gecko python cobra viper spider beetle cricket hornet butterfly caterpillar
dragonfly ladybug mosquito sparrow pigeon robin eagle vulture pelican flamingo ostrich peacock swan goose turkey
chicken rooster hedgehog porcupine raccoon skunk moose reindeer antelope gazelle cheetah jaguar hyena jackal
coyote horse sheep cattle bison llama alpaca kangaroo wombat platypus jellyfish starfish seahorse snail frog
salamander mouse ferret lynx cougar gorilla chimpanzee baboon lemur sloth armadillo anteater hippo rhino dragon
apple banana cherry lemon orange pepper butter nectar grape melon mango papaya peach plum apricot coconut
pineapple strawberry blueberry raspberry cranberry olive tomato potato carrot onion garlic ginger celery cabbage
lettuce spinach broccoli cucumber pumpkin squash turnip radish beetroot avocado almond walnut peanut cashew
hazelnut chestnut bread toast bagel muffin cookie biscuit pancake waffle noodle pasta pizza burger sandwich
salad soup curry rice cereal honey sugar vinegar mustard ketchup cheese yogurt cream coffee juice lemonade
chocolate caramel vanilla cinnamon nutmeg pretzel popcorn cracker dumpling omelette sausage bacon window pencil
candle mirror pocket ladder cotton basket lantern magnet needle saddle jacket blanket pillow curtain carpet
cushion table chair sofa bench stool shelf drawer cupboard closet wardrobe kettle teapot saucepan skillet spoon
knife plate bowl bottle bucket broom sponge towel brush razor scissors stapler eraser marker crayon notebook
envelope stamp ribbon button zipper thimble thread sweater scarf glove mitten sandal slipper helmet umbrella
wallet purse suitcase backpack hammer wrench screwdriver shovel drill chisel pliers hinge padlock doorbell clock
radio camera telescope microscope compass calendar battery printer keyboard monitor speaker garden river
mountain forest bridge meadow ocean island glacier harbor jungle tunnel valley canyon desert prairie volcano
waterfall lagoon stream creek beach shore cliff ridge summit plateau swamp marsh delta coral pebble boulder
crystal diamond emerald ruby sapphire pearl amber granite marble quartz copper silver bronze thunder lightning
rainbow cloud storm breeze tornado blizzard snowflake icicle sunrise sunset twilight midnight morning evening
autumn spring summer winter season weather planet comet meteor galaxy universe castle igloo cottage cabin palace
temple tower lighthouse windmill stable garage kitchen bedroom bathroom attic cellar balcony porch hallway
library museum theater stadium airport station hospital school college office factory market bakery pharmacy
hotel restaurant village city orchard vineyard rocket wagon engine bicycle tricycle scooter motorcycle carriage
chariot train subway taxi truck tractor bulldozer ambulance helicopter airplane glider balloon sailboat canoe
kayak ferry yacht submarine anchor paddle violet yellow purple indigo crimson scarlet maroon turquoise magenta
lavender ivory velvet silk wool linen leather paper cardboard plastic rubber glass ceramic puzzle riddle whistle
trumpet violin guitar piano flute drum harp cello banjo tambourine orchestra melody rhythm concert poetry novel
story fable legend ballad painting sculpture portrait canvas easel palette sketch pattern circle square triangle
rectangle cylinder sphere pyramid spiral shadow journey voyage treasure kingdom empire festival holiday birthday
wedding picnic parade carnival circus juggler magician wizard knight pirate sailor farmer baker butcher doctor
nurse teacher painter dancer singer pilot captain soldier hunter gardener carpenter plumber tailor adventure
alligator aquarium astronaut avalanche backyard ballerina bandage barbecue basketball blackboard bookshelf
boomerang bracelet briefcase broomstick brownie calculator campfire candlestick cardigan cartoon cathedral
champion chandelier chimney classroom clipboard cupcake daffodil dandelion dinosaur doughnut driveway earthquake
eggplant fireplace firework fountain footprint friendship gingerbread goldfish grasshopper greenhouse hairbrush
hamburger handshake horseshoe hurricane iceberg invitation jigsaw keyhole landscape lollipop mailbox marshmallow
meatball motorboat mushroom necklace nightingale nutcracker overcoat paintbrush parachute passenger peppermint
photograph pinecone playground pocketknife postcard quicksand rattlesnake sandcastle saxophone scarecrow
seashell shipwreck skateboard skyscraper snowman spaceship sunflower surfboard swordfish tablecloth teaspoon
thermometer thunderstorm toothbrush toothpaste trampoline treehouse typewriter underground unicorn vacuum
volleyball watermelon wheelbarrow whirlpool windshield woodpecker xylophone yardstick zookeeper caravan
crocodile emperor explorer evergreen flashlight gladiator hourglass jellybean kingfisher ladybird lumberjack
mandolin marigold mermaid moonlight nightgown orangutan paperclip peninsula persimmon porridge raincoat rosemary
sandpaper scorpion snowboard spearmint stopwatch sugarcane tangerine tarantula toadstool tortilla blacksmith
buttercup cornflower honeycomb milestone nightfall riverbank shoelace sunshine timetable wristwatch workbench
""".split()
        )
    )
)
"""Plain lowercase English words, sorted: the words of the letter tasks and of the word lists."""

CONVERSIONS = (  # (from unit, to unit, factor, largest amount)
    ("hours", "minutes", 60, 48),
    ("minutes", "seconds", 60, 90),
    ("days", "hours", 24, 60),
    ("weeks", "days", 7, 99),
    ("kilometres", "metres", 1000, 99),
    ("metres", "centimetres", 100, 99),
    ("kilograms", "grams", 1000, 99),
    ("litres", "millilitres", 1000, 99),
)


def _numbers(rng: random.Random, low: int, high: int, count_low: int, count_high: int) -> list[int]:
    """``count_low`` to ``count_high`` distinct numbers from ``low`` to ``high``, in random order."""
    return rng.sample(range(low, high + 1), rng.randint(count_low, count_high))


def _add(rng):
    a, b = rng.randint(10, 89), rng.randint(10, 89)
    return f"What is {a} + {b}?", str(a + b)


def _subtract(rng):
    a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
    return f"What is {a} - {b}?", str(a - b)


def _convert(rng):
    source, target, factor, largest = rng.choice(CONVERSIONS)
    amount = rng.randint(2, largest)
    return f"How many {target} are in {amount} {source}?", str(factor * amount)


def _count(rng):
    word = rng.choice(WORDS)
    return f"How many letters are in the word '{word}'?", str(len(word))


def _upper(rng):
    word = rng.choice(WORDS)
    return f"Write the word '{word}' in capital letters.", word.upper()


def _first(rng):
    word = rng.choice(WORDS)
    return f"What is the first letter of the word '{word}'?", word[0]


def _next(rng):
    n = rng.randint(10, 998)
    return f"What number comes after {n}?", str(n + 1)


def _spell(rng):
    word = rng.choice(WORDS)
    return f"Spell the word '{word}' letter by letter.", "-".join(word)


def _reverse(rng):
    if rng.random() < 0.5:
        items = rng.sample(WORDS, rng.randint(4, 7))
        kind = "words"
    else:
        items = [str(n) for n in _numbers(rng, 1, 99, 5, 10)]
        kind = "numbers"
    return f"Reverse the order of these {kind}: {', '.join(items)}", ", ".join(reversed(items))


def _sort(rng):
    numbers = _numbers(rng, 1, 99, 5, 10)
    return (
        f"Sort these numbers from smallest to largest: {', '.join(map(str, numbers))}",
        ", ".join(map(str, sorted(numbers))),
    )


def _range(rng):
    start = rng.randint(1, 120)
    end = start + rng.randint(5, 11)
    return f"Count from {start} to {end}.", ", ".join(str(n) for n in range(start, end + 1))


GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "subtract": _subtract,
    "convert": _convert,
    "count": _count,
    "upper": _upper,
    "first": _first,
    "next": _next,
    "spell": _spell,
    "reverse": _reverse,
    "sort": _sort,
    "range": _range,
}
"""One random (question, answer) of each task per call; the keys are exactly ``INSTRUCTION_TASKS``."""


def splits(seed: int = SEED) -> dict[str, list[dict[str, str]]]:
    """The rows ``{"task", "question", "answer"}`` of each split (``training``, ``validation``, ``test``)."""
    if tuple(GENERATORS) != tuple(INSTRUCTION_TASKS):
        raise RuntimeError(f"the generators {list(GENERATORS)} differ from INSTRUCTION_TASKS {list(INSTRUCTION_TASKS)}")
    rng = random.Random(seed)
    seen: set[str] = set()
    result: dict[str, list[dict[str, str]]] = {"training": [], "validation": [], "test": []}
    for task, generate in GENERATORS.items():
        rows = []
        while len(rows) < PER_TASK:
            question, answer = generate(rng)
            if question not in seen:
                seen.add(question)
                rows.append({"task": task, "question": question, "answer": answer})
        start = 0
        for split, size in SPLIT_SIZES.items():
            result[split] += rows[start : start + size]
            start += size
        result["training"] += rows[start:]
    for rows in result.values():
        rng.shuffle(rows)
    return result


def write(folder: Path) -> None:
    """Write ``{training,validation,test}.jsonl`` into ``folder``, one ``{"messages", "task"}`` chat a line."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in splits().items():
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as handle:
            for row in rows:
                messages = [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": row["question"]},
                    {"role": "assistant", "content": row["answer"]},
                ]
                handle.write(json.dumps({"messages": messages, "task": row["task"]}) + "\n")
        print(f"{name}: {len(rows)} examples -> {folder / f'{name}.jsonl'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("folder", nargs="?", type=Path, default=OUT, help=f"output folder (default {OUT})")
    write(parser.parse_args(argv).folder)


if __name__ == "__main__":
    main()
