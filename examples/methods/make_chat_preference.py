"""Deterministic generator of a public-style preference set: ShareGPT conversations in English with long answers.

It imitates what the public sets (HH-RLHF, UltraFeedback, the ShareGPT-derived DPO mixes) hold, rather than a
token-level contrast: a human asks an everyday question (sometimes after an earlier exchange), and

- ``chosen`` is a helpful answer: specific, correct steps for that question, several sentences long;
- ``rejected`` is what annotators ranked lower, of a similar length, one of
  - *wrong*: confident, fluent advice for the same question that is mistaken (the errors real answers make),
  - *evasive*: hedging that never answers ("it depends", "ask a professional"), padded to the same length,
  - *unhelpful*: a dismissive or off-hand reply that restates the question and trails off into generalities.

Topics are split between the two files: the eval conversations ask about topics no training conversation
mentions, so a rise in held-out preference accuracy is a preference learned, not a topic remembered.

    python examples/methods/make_chat_preference.py [OUT_DIR]   # writes chat_preference_{train,eval}.jsonl

Record format (ShareGPT preference, as the public mixes publish it)::

    {"conversations": [{"from": "human", "value": ...}, ...], "chosen": {"from": "gpt", "value": ...},
     "rejected": {"from": "gpt", "value": ...}, "rejected_kind": "wrong" | "evasive" | "unhelpful", "topic": ...}
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# topic: (questions, helpful sentences (in order), wrong sentences (same question, mistaken advice))
TOPICS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "router": (
        ["My home wifi keeps dropping every few minutes. How can I fix it?", "Why does my wifi disconnect all the time and what should I do?"],
        ["Start by restarting the router: unplug it, wait thirty seconds and plug it back in.",
         "Then log in to its settings page and update the firmware, since old firmware often causes drops.",
         "Move the router to a central, raised spot away from microwaves and thick walls.",
         "If neighbours use the same channel, switch to a less crowded one such as 1, 6 or 11 on 2.4 GHz."],
        ["Wifi drops are caused by the cable from the wall, so you should replace it with a longer one.",
         "Put the router inside a metal cabinet, which shields it from interference and makes the signal stronger.",
         "Never update the firmware, because updates are the main reason routers become unstable.",
         "Turning the transmit power down to the minimum will also make the connection more reliable."],
    ),
    "bread": (
        ["How do I bake a simple loaf of bread at home?", "Can you give me an easy recipe for homemade bread?"],
        ["Mix 500 grams of flour, 10 grams of salt, 7 grams of dried yeast and about 320 millilitres of warm water.",
         "Knead the dough for ten minutes until it is smooth and springs back when pressed.",
         "Let it rise in a covered bowl for an hour, until it has doubled in size.",
         "Shape it, let it rise again for thirty minutes, and bake at 220 degrees for about thirty minutes until the base sounds hollow."],
        ["Mix the flour with boiling water, because hot water wakes the yeast up faster.",
         "Add the salt straight onto the yeast and leave them together for an hour before mixing.",
         "Skip the kneading and the rising, since they only change how the loaf looks.",
         "Bake it at 120 degrees for three hours so that it cooks evenly all the way through."],
    ),
    "python_list": (
        ["In Python, how do I remove duplicates from a list but keep the order?", "What is the best way to deduplicate a Python list while keeping the original order?"],
        ["Use a dictionary, because since Python 3.7 dictionaries keep insertion order.",
         "Write list(dict.fromkeys(items)) and you get each element once, in the order it first appeared.",
         "This runs in linear time and works for any hashable elements such as strings and numbers.",
         "If the elements are not hashable, loop over the list and append each one you have not seen yet to a new list."],
        ["Use list(set(items)), which removes duplicates and always keeps the original order.",
         "Sorting the list first with items.sort() also keeps the order the elements had before.",
         "Python lists cannot contain duplicates, so you only need to check for them once.",
         "Calling items.remove() inside a loop over the same list is the fastest and safest way."],
    ),
    "sleep": (
        ["I have trouble falling asleep at night. Any advice?", "What can I do to fall asleep faster in the evening?"],
        ["Keep the same bedtime and wake-up time every day, including weekends.",
         "Avoid caffeine after early afternoon and heavy meals in the two hours before bed.",
         "Put screens away about an hour before sleeping and keep the bedroom dark, quiet and cool.",
         "If you are still awake after twenty minutes, get up, do something calm in dim light, and go back when you feel sleepy."],
        ["Drink a strong coffee before bed, since caffeine relaxes the body after a few hours.",
         "Change your bedtime every night so that your body never gets used to one schedule.",
         "Keep the room as warm and bright as possible, which signals to the brain that it is time to rest.",
         "Stay in bed staring at the clock until you fall asleep, however long it takes."],
    ),
    "bike_chain": (
        ["My bicycle chain keeps slipping. What should I check?", "How do I stop my bike chain from skipping gears?"],
        ["First clean and lubricate the chain, because dirt makes it skip on the teeth.",
         "Check chain wear with a chain checker tool; a stretched chain slips and should be replaced.",
         "Adjust the rear derailleur with the barrel adjuster, a quarter turn at a time, until shifts are clean.",
         "If the chain is new but still skips, the cassette teeth are probably worn and need replacing too."],
        ["A slipping chain means the tyres are underinflated, so pump them to the maximum pressure.",
         "Wash all the grease off the chain with soap and leave it dry, since oil attracts dirt.",
         "Tighten the limit screws as far as they go, which locks the derailleur in place.",
         "A stretched chain works better than a new one, so never replace it."],
    ),
    "resume": (
        ["How should I write a resume for my first job?", "What should a good resume look like if I have little experience?"],
        ["Keep it to one page with your name and contact details at the top.",
         "Lead with education and any projects, volunteering or part-time work, each with a concrete result.",
         "Start bullet points with action verbs and include numbers where you can, such as hours or people served.",
         "Tailor the skills section to the job description and ask someone to proofread it before sending."],
        ["Make it at least five pages long so that the employer sees how much effort you put in.",
         "Leave out your contact details, since recruiters will find you through the company website.",
         "Use the same resume for every job without changing anything, which shows consistency.",
         "List your hobbies first and put education at the very end, as employers rarely read it."],
    ),
    "houseplant": (
        ["The leaves on my houseplant are turning yellow. What am I doing wrong?", "Why is my indoor plant getting yellow leaves?"],
        ["Yellow leaves most often mean overwatering, so let the top few centimetres of soil dry before watering again.",
         "Make sure the pot has drainage holes and empty the saucer after watering.",
         "Check the light: most houseplants want bright, indirect light rather than a dark corner or harsh sun.",
         "If the problem continues, repot into fresh soil in spring and feed lightly once a month during the growing season."],
        ["Yellow leaves mean the plant is thirsty, so water it every day until the soil stays soaked.",
         "Choose a pot without drainage holes, which keeps the water where the roots need it.",
         "Move it into the darkest room of the house, since direct light is what turns leaves yellow.",
         "Give it a full dose of fertiliser every day to make the green come back."],
    ),
    "budget": (
        ["How do I start making a monthly budget?", "What is a simple way to budget my money each month?"],
        ["Add up your take-home pay, then list fixed costs such as rent, utilities and loan payments.",
         "Track every expense for a month so you know what you really spend on food, transport and fun.",
         "A common rule is fifty percent for needs, thirty for wants and twenty for savings and debt.",
         "Set up an automatic transfer to savings on payday and review the budget at the end of each month."],
        ["Budget with your gross salary before tax, since that is the money you really have to spend.",
         "Do not track expenses, because knowing the numbers only makes spending more stressful.",
         "Put savings last and only save whatever happens to be left at the end of the year.",
         "Use a credit card for everything and pay only the minimum, which builds wealth faster."],
    ),
    "git_undo": (
        ["How do I undo my last git commit without losing the changes?", "I committed too early in git. How can I take the commit back but keep my edits?"],
        ["Run git reset --soft HEAD~1, which removes the last commit and keeps its changes staged.",
         "If you want the changes unstaged as well, use git reset HEAD~1 instead, the default mixed mode.",
         "Both keep your edits in the working tree, so nothing is lost.",
         "If you already pushed the commit, prefer git revert, which adds a new commit that undoes it without rewriting shared history."],
        ["Run git reset --hard HEAD~1, which undoes the commit and keeps all your changes safely.",
         "Delete the .git folder and run git init again to start from a clean history.",
         "Force-push to the shared branch after rewriting, since other people's copies update automatically.",
         "Git cannot undo commits, so the only option is to copy the files elsewhere and clone again."],
    ),
    "running": (
        ["I want to start running. How should a beginner train?", "What is a good plan for someone who has never run before?"],
        ["Begin with three sessions a week that alternate one minute of running with two minutes of walking.",
         "Each week, lengthen the running parts a little while keeping an easy pace at which you can still talk.",
         "Wear comfortable shoes that fit well and take a rest day between sessions so your legs recover.",
         "After about eight weeks most beginners can run thirty minutes without stopping."],
        ["Run as fast as you can every day from the first day, since soreness shows the training works.",
         "Skip rest days entirely, because muscles only grow while you are moving.",
         "Any shoes will do, and running barefoot on concrete is best for beginners.",
         "Aim for a marathon in the first month so that you stay motivated."],
    ),
    "tea_stain": (
        ["How do I get a tea stain out of a white shirt?", "I spilled tea on my white cotton shirt. How can I clean it?"],
        ["Rinse the stain from the back with cold water as soon as possible to push the tea out of the fibres.",
         "Rub in a little liquid laundry detergent and let it sit for fifteen minutes.",
         "For an old stain, soak the shirt in cold water with an oxygen bleach for an hour.",
         "Wash as usual and check the stain before drying, because heat from the dryer can set it."],
        ["Pour boiling water on the stain, which sets the colour and makes it disappear.",
         "Rub the stain hard with a dry cloth to spread it thinly so it fades.",
         "Put the shirt straight in a hot dryer, since heat lifts tea out of cotton.",
         "Use a coloured dye on the whole shirt so that the stain matches the rest."],
    ),
    "interview": (
        ["How can I prepare for a job interview next week?", "What should I do to get ready for an interview?"],
        ["Research the company: what it makes, its customers and any recent news.",
         "Prepare short stories about past work using the situation, task, action and result structure.",
         "Practise answers to common questions out loud, ideally with a friend who can give feedback.",
         "Prepare two or three questions to ask the interviewer and plan your route so you arrive ten minutes early."],
        ["Do not research the company, since interviewers prefer candidates who know nothing about them.",
         "Memorise a script word for word and recite it no matter what question is asked.",
         "Arrive an hour late, which shows that you are in demand elsewhere.",
         "Never ask questions at the end, because it makes you look unprepared."],
    ),
    "spreadsheet": (
        ["How do I add up a column of numbers in a spreadsheet?", "What is the formula to total a column in Excel or Google Sheets?"],
        ["Click the cell below the numbers and type =SUM(A2:A20), adjusting the range to your column.",
         "Press Enter and the total appears; it updates by itself when any number changes.",
         "You can also select the cells and use the AutoSum button, which guesses the range for you.",
         "To add only some rows, use SUMIF, for example =SUMIF(B2:B20, \"rent\", A2:A20)."],
        ["Type the numbers into a calculator and write the result into the cell by hand.",
         "Use =COUNT(A2:A20), which returns the total of all the values in the column.",
         "Formulas must go above the numbers they add, otherwise spreadsheets ignore them.",
         "A total only updates if you delete the formula and type it again after each change."],
    ),
    "dog_training": (
        ["How do I teach my puppy to sit?", "What is the easiest way to train a young dog to sit on command?"],
        ["Hold a small treat just above the puppy's nose and slowly move it back over its head.",
         "As its head follows the treat, its bottom will lower; the moment it sits, say yes and give the treat.",
         "Repeat this five to ten times in short sessions, and add the word sit once it reliably follows the treat.",
         "Gradually use fewer treats and reward with praise, and practise in different rooms so the habit generalises."],
        ["Push the puppy's back down hard every time, since force teaches faster than rewards.",
         "Train for two hours at a time so the puppy learns everything in one day.",
         "Give the treat before it sits, which shows it what you want.",
         "Shout the command as loudly as possible, because puppies only listen to loud voices."],
    ),
    "passwords": (
        ["How can I keep my online accounts secure?", "What should I do to protect my accounts from being hacked?"],
        ["Use a different long password for every account, and let a password manager create and remember them.",
         "Turn on two-factor authentication, preferably with an authenticator app rather than text messages.",
         "Be wary of emails that ask you to log in through a link; open the site yourself instead.",
         "Keep your devices and browser updated, since updates close security holes attackers use."],
        ["Use the same short password everywhere, which makes it easy to remember and hard to guess.",
         "Turn off two-factor authentication, because it gives hackers a second way in.",
         "Click login links in emails quickly, before they expire.",
         "Avoid updates, since they often install spyware on your device."],
    ),
    "rice": (
        ["How do I cook fluffy rice on the stove?", "My rice always turns out sticky. How do I cook it properly?"],
        ["Rinse one cup of long-grain rice in cold water until the water runs almost clear, which removes surface starch.",
         "Put it in a pot with one and a half cups of water and a pinch of salt and bring it to a boil.",
         "Cover, turn the heat to the lowest setting and cook for fifteen minutes without lifting the lid.",
         "Take it off the heat, leave it covered for ten minutes, then fluff it with a fork."],
        ["Never rinse the rice, since the starch is what keeps the grains apart.",
         "Use four cups of water per cup of rice and stir it constantly while it boils.",
         "Keep the heat on high and lift the lid every minute to check it.",
         "Serve it as soon as the water boils, because resting makes rice sticky."],
    ),
    "email_tone": (
        ["How do I write a polite email asking my manager for a day off?", "Can you help me ask my boss for a day off by email?"],
        ["Use a clear subject line such as day off request for the date you want.",
         "Open with a short greeting, then state the date and that you would like to take it as leave.",
         "Mention how your work will be covered, for example that you will finish the report the day before.",
         "Close by thanking them and offering to discuss it, and send it well in advance."],
        ["Leave the subject empty so the email feels more personal.",
         "Tell your manager you are taking the day off without asking, since requests look weak.",
         "Do not mention your work at all, because it is not your job to plan for your absence.",
         "Send it at midnight the day before so they have no time to say no."],
    ),
    "car_battery": (
        ["My car won't start and I think the battery is dead. What do I do?", "How do I jump-start a car with a flat battery?"],
        ["Park a working car close by, turn both engines off and connect the red cable to the plus terminal of the flat battery.",
         "Connect the other red clamp to the plus terminal of the good battery, then the black cable to its minus terminal.",
         "Attach the last black clamp to bare metal on the engine block of the dead car, away from the battery.",
         "Start the working car, wait a few minutes, then start yours and remove the cables in reverse order."],
        ["Connect the red cable from the plus of one battery to the minus of the other, which gives more power.",
         "Keep both engines running while you attach the clamps, since that protects the electronics.",
         "Touch the two clamps together first to check that the cables work.",
         "Pour water on the battery terminals to improve the connection."],
    ),
    "study": (
        ["How can I study more effectively for exams?", "What study techniques actually help me remember things for a test?"],
        ["Spread your study over several days instead of cramming, because spaced review helps memory last.",
         "Test yourself with practice questions or flashcards rather than rereading notes.",
         "Study in focused blocks of about twenty-five minutes with short breaks in between.",
         "Explain each topic in your own words, and sleep well the night before the exam."],
        ["Cram everything the night before, since memory works best under pressure.",
         "Reread your notes many times, which is the most effective way to learn.",
         "Study for eight hours without breaks so you never lose focus.",
         "Stay awake all night before the exam, because sleep erases what you learned."],
    ),
    "paint_wall": (
        ["How do I paint a room without making a mess?", "What are the steps to paint a bedroom wall neatly?"],
        ["Move furniture to the middle, cover it and the floor with drop cloths, and tape the edges of trim and ceiling.",
         "Fill holes with filler, sand them smooth and wipe the wall with a damp cloth.",
         "Cut in along the edges with a brush first, then roll the rest in overlapping W shapes.",
         "Let the first coat dry fully, apply a second, and remove the tape while the paint is still slightly soft."],
        ["Leave the furniture where it is, since paint wipes off fabric easily.",
         "Paint straight over holes and dust, which the paint will fill by itself.",
         "Use a single thick coat so that it dries faster and covers better.",
         "Remove the tape a week later when the paint is completely hard."],
    ),
    "headache": (
        ["I get headaches most afternoons at work. What might help?", "What can I do about frequent afternoon headaches?"],
        ["Drink water regularly through the day, since mild dehydration is a common trigger.",
         "Take short breaks from the screen, and check that your monitor is at eye level and not too bright.",
         "Eat a proper lunch and keep caffeine steady rather than having a lot at once.",
         "If the headaches are frequent or severe, keep a diary of when they happen and see a doctor."],
        ["Stop drinking water during the day, because fluids make headaches worse.",
         "Move the screen as close to your eyes as possible and turn the brightness to maximum.",
         "Skip lunch, since digestion takes blood away from the head.",
         "Never see a doctor about headaches, as they always go away on their own."],
    ),
    "sql_join": (
        ["What is the difference between an inner join and a left join in SQL?", "When should I use a left join instead of an inner join?"],
        ["An inner join returns only the rows that have a match in both tables.",
         "A left join returns every row of the left table, with the matching columns of the right table or nulls where there is no match.",
         "Use a left join when you need all records from the first table, for example every customer including those without orders.",
         "To find rows without a match, add WHERE right_table.id IS NULL after a left join."],
        ["An inner join returns every row from both tables, whether or not they match.",
         "A left join only returns the rows of the right table that have no match.",
         "The two are the same, and the keyword only changes the order of the columns.",
         "A left join removes null values, so it is used to clean the data."],
    ),
    "moving": (
        ["I'm moving to a new apartment next month. How should I organise it?", "How do I plan a house move so it goes smoothly?"],
        ["Book a moving company or van early and get boxes, tape and markers a few weeks ahead.",
         "Pack room by room, starting with things you rarely use, and label each box with its room and contents.",
         "Keep an essentials bag with documents, chargers, medicine and a change of clothes.",
         "Update your address with the bank and post office and arrange for utilities to start on moving day."],
        ["Wait until the day before to book a van, since prices drop at the last minute.",
         "Pack everything into unlabelled boxes so that unpacking is a surprise.",
         "Put your documents and keys in the bottom of a random box for safety.",
         "Do not tell anyone your new address until a few months after the move."],
    ),
    "compost": (
        ["How do I start composting at home?", "What do I need to make compost in my garden?"],
        ["Choose a bin or a corner of the garden with some drainage and partial shade.",
         "Mix green material such as vegetable scraps and grass with brown material such as dry leaves and cardboard.",
         "Keep the pile as moist as a wrung-out sponge and turn it every week or two to let air in.",
         "Leave out meat, dairy and oily food, and after a few months the bottom will be dark, crumbly compost."],
        ["Put the compost in a sealed plastic bag so that no air gets in.",
         "Use only meat and dairy scraps, which break down the fastest.",
         "Keep the pile completely dry, since water stops the process.",
         "Never turn the pile, because mixing kills the useful bacteria."],
    ),
}

# Evasive and unhelpful replies are composed from short clauses (fewer than 13 words each), so that two replies share
# a style (hedging, brushing off) but rarely a long run of words, as in real sets -- and trainpipe's decontamination
# (13-gram overlap with the eval split) and near-dedup keep them.
HEDGES = ["it really depends", "that is hard to say", "there is no single answer", "opinions differ a lot",
          "it varies from case to case", "nobody can say for sure", "everyone is different", "it is complicated"]
DEFERS = ["you could search online", "ask someone with more experience", "a professional could tell you",
          "look for a forum about {topic}", "maybe read a book on {topic}", "check with an expert first",
          "see what your friends think", "try a few things and see"]
VAGUE = ["there are many factors involved", "{topic} is a broad subject", "what works for one person may not work for you",
         "the details matter a great deal", "circumstances change all the time", "it comes down to preference",
         "there are pros and cons either way", "it is a personal decision"]
BRUSH = ["I would not worry about it", "these things happen", "it usually sorts itself out", "it is not that important",
         "people deal with {topic} all the time", "most people figure it out eventually", "just go with your gut",
         "it is probably fine as it is"]
TRAIL = ["Anyway, good luck.", "Hope that makes sense.", "That is all really.", "Just my two cents.", "Whatever works for you."]
LINKS = [", and ", ", so ", ". ", ", but ", "; "]


def _clauses(pools: list[list[str]], rng: random.Random, target: int, topic: str) -> str:
    """Clauses drawn from ``pools`` in turn and joined by varied links until about ``target`` characters."""
    text, k = "", 0
    while len(text) < target:
        clause = rng.choice(pools[k % len(pools)]).format(topic=topic)
        if not text:
            text = clause[0].upper() + clause[1:]
        else:
            link = rng.choice(LINKS)
            text += link + (clause[0].upper() + clause[1:] if link.strip() == "." else clause)
        k += 1
    return text + ". " + rng.choice(TRAIL)


OPENERS = ["", "Sure! ", "Good question. ", "Here is what usually works. ", "Happy to help. "]
CLOSERS = ["", " Let me know if anything is unclear.", " Hope this helps!", " Feel free to ask if you want more detail."]
PREVIOUS = [  # an earlier exchange before the question, as in multi-turn ShareGPT conversations
    ("Hi, can I ask you something?", "Of course, what would you like to know?"),
    ("I have a practical question.", "Sure, go ahead."),
    ("Hello! I need some advice.", "Hi! I'm happy to help. What is it about?"),
]
TOPIC_NAMES = {k: k.replace("_", " ") for k in TOPICS}
EVAL_TOPICS = ("tea_stain", "git_undo", "compost", "dog_training", "car_battery", "sql_join")


def pair(topic: str, rng: random.Random, kind: str) -> dict:
    questions, helpful, wrong = TOPICS[topic]
    name = TOPIC_NAMES[topic]
    question = rng.choice(questions)
    conv = []
    if rng.random() < 0.3:
        h, g = rng.choice(PREVIOUS)
        conv += [{"from": "human", "value": h}, {"from": "gpt", "value": g}]
    if rng.random() < 0.3:
        question = rng.choice(["I'm a complete beginner. ", "Quick question: ", "Please keep it practical. "]) + question
    conv.append({"from": "human", "value": question})
    opener, closer = rng.choice(OPENERS), rng.choice(CLOSERS)
    keep = sorted(rng.sample(range(len(helpful)), 3))  # three of the steps, in order: answers to one question differ
    chosen = opener + " ".join(helpful[i] for i in keep) + closer
    if kind == "wrong":
        bad = sorted(rng.sample(range(len(wrong)), 3))
        rejected = opener + " ".join(wrong[i] for i in bad) + closer
    elif kind == "evasive":
        rejected = _clauses([HEDGES, VAGUE, DEFERS], rng, len(chosen) - 20, name)
    else:
        rejected = _clauses([BRUSH, VAGUE], rng, len(chosen) - 20, name)
    return {"conversations": conv, "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected},
            "rejected_kind": kind, "topic": topic}


def make(train_per_topic: int = 9, eval_per_topic: int = 5, seed: int = 7) -> tuple[list[dict], list[dict]]:
    """(train pairs, eval pairs): eval topics never appear in train; rejected kinds cycle wrong, evasive, unhelpful."""
    rng = random.Random(seed)
    kinds = ("wrong", "evasive", "unhelpful")
    train, evals = [], []
    for topic in TOPICS:
        held_out = topic in EVAL_TOPICS
        for i in range(eval_per_topic if held_out else train_per_topic):
            (evals if held_out else train).append(pair(topic, rng, kinds[i % 3]))
    rng.shuffle(train)
    return train, evals


def write(out_dir: Path, **kw) -> tuple[Path, Path]:
    train, evals = make(**kw)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "chat_preference_train.jsonl", out_dir / "chat_preference_eval.jsonl"
    for path, rows in zip(paths, (train, evals)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths


if __name__ == "__main__":
    tr, ev = write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "data")
    print(f"wrote {tr} and {ev}")
