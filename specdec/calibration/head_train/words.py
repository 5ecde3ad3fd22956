"""Word lists and templates the training prompts are made of (specdec.calibration.head_train.prompts). Plain data:
varied subjects, tasks and tones, none taken from the benchmark prompts (a test checks that the prompts made of them
and benchmarks/prompts/ are disjoint)."""

CONCEPTS = (
    "photosynthesis", "inflation", "gravity", "a black hole", "the water cycle", "compound interest", "democracy",
    "machine learning", "a vaccine", "plate tectonics", "supply and demand", "the immune system", "electricity",
    "a blockchain", "evolution by natural selection", "climate change", "the stock market", "a recursive function",
    "the internet", "a hash table", "quantum entanglement", "the greenhouse effect", "a credit score", "DNA",
    "the Pythagorean theorem", "an operating system", "a neural network", "the French Revolution", "encryption",
    "the placebo effect", "a mortgage", "the speed of light", "an ecosystem", "opportunity cost", "a compiler",
    "the Roman Empire", "a solar eclipse", "cloud computing", "antibiotic resistance", "the printing press",
    "a database index", "the scientific method", "renewable energy", "a sorting algorithm", "the human brain",
    "a budget deficit", "ocean tides", "version control", "the Renaissance", "a virus", "the metric system",
    "an API", "the Industrial Revolution", "a rainbow", "probability", "a volcano", "the circulatory system",
    "object-oriented programming", "the Silk Road", "a thunderstorm", "a limited liability company", "recycling",
    "the Big Bang", "a microwave oven", "a search engine", "the moon's phases", "magnetism", "a cover letter",
)

PAIRS = (
    ("a list", "a tuple"), ("weather", "climate"), ("a virus", "a bacterium"), ("stocks", "bonds"),
    ("RAM", "a hard drive"), ("a crocodile", "an alligator"), ("speed", "velocity"), ("a loan", "a grant"),
    ("TCP", "UDP"), ("an atom", "a molecule"), ("a comet", "an asteroid"), ("baking soda", "baking powder"),
    ("a simile", "a metaphor"), ("SQL", "NoSQL databases"), ("a county", "a state"), ("mass", "weight"),
    ("a debit card", "a credit card"), ("a lake", "a pond"), ("Python", "JavaScript"), ("a tornado", "a hurricane"),
    ("a violin", "a viola"), ("an interpreter", "a compiler"), ("a poem", "a song"), ("empathy", "sympathy"),
    ("a frog", "a toad"), ("a republic", "a monarchy"), ("HTTP", "HTTPS"), ("a startup", "a small business"),
)

ACTIVITIES = (
    "learning a new language", "saving money", "running a first marathon", "studying for exams", "cooking at home",
    "keeping a houseplant alive", "public speaking", "writing a novel", "starting a vegetable garden",
    "travelling on a budget", "learning to code", "staying focused", "training a puppy", "moving to a new city",
    "making friends as an adult", "preparing for a job interview", "reducing screen time", "learning the guitar",
    "organizing a small kitchen", "taking better photos", "reading more books", "cycling to work",
    "staying healthy in winter", "planning a wedding", "managing a small team", "camping with children",
    "cleaning up a messy codebase", "recovering from a cold", "drinking more water", "painting with watercolours",
)

HOWTOS = (
    "change a flat tyre", "make bread without yeast", "write a good resume", "back up my phone",
    "remove a coffee stain", "set up a home network", "calculate a percentage", "start meditating",
    "negotiate a salary", "clean a cast iron pan", "read a nutrition label", "write a thank-you note",
    "choose a good password", "tie a bowline knot", "reverse a string in Python", "make a budget spreadsheet",
    "fold a fitted sheet", "plant a tree", "improve my handwriting", "prepare for a long flight",
    "install a Python package", "keep a journal", "cook rice on the stove", "apologize to a friend",
)

CHARACTERS = (
    "a retired pilot", "a young baker", "a curious cat", "an old fisherman", "a shy librarian", "a lost robot",
    "a street musician", "a tired nurse", "a clever fox", "a girl who can talk to birds", "a grumpy wizard",
    "a lonely astronaut", "a village doctor", "a boy with a broken bicycle", "a travelling painter",
    "a dragon who is afraid of fire", "a detective with a bad memory", "two brothers who run a bakery",
    "a teacher on her last day of work", "an inventor in a small town", "a penguin who wants to fly",
    "a ghost who lives in a museum", "a farmer during a long drought", "a chess champion",
)

EVENTS = (
    "finds a map in an old book", "wakes up in a different century", "loses the key to everything",
    "receives a letter with no name on it", "must cross a frozen lake", "discovers a hidden door in the garden",
    "meets a stranger on a night train", "has to save the town festival", "wins a prize by mistake",
    "hears music coming from an empty house", "builds a boat from scrap wood", "gets stuck in an elevator",
    "finds a talking plant", "has one day to keep a promise", "opens a shop that sells memories",
    "follows a trail of paper cranes", "forgets how to speak for a day", "is asked to guard a mysterious egg",
)

PLACES = (
    "a small island", "a busy train station", "an abandoned factory", "a mountain village", "a space station",
    "a desert town", "a night market", "a flooded city", "an old castle", "a forest cabin", "a school at midnight",
    "a lighthouse in the fog", "a crowded beach", "a quiet monastery", "an underground library",
)

POEM_TOPICS = (
    "the first snow", "an old dog", "the city at night", "a summer storm", "friendship", "the ocean", "coffee",
    "a train journey", "spring flowers", "the stars", "a grandmother's kitchen", "silence", "autumn leaves",
    "a lost glove", "the moon", "Monday mornings", "a river", "home", "courage", "the wind",
)

RECIPIENTS = (
    ("my landlord", "a broken heater"), ("a customer", "a delayed order"), ("my manager", "taking a day off"),
    ("a colleague", "a project deadline"), ("a teacher", "my child's absence"), ("the city council", "a pothole"),
    ("a hotel", "a lost jacket"), ("a client", "a price increase"), ("my team", "a new meeting schedule"),
    ("a neighbour", "a noisy party"), ("a professor", "an extension for an essay"), ("a supplier", "a wrong delivery"),
)

PRODUCTS = (
    "a reusable water bottle", "noise-cancelling headphones", "a standing desk", "a solar phone charger",
    "a smart thermostat", "a hiking backpack", "an electric kettle", "a children's picture book", "a yoga mat",
    "a handmade ceramic mug", "a folding bicycle", "a board game about trains",
)

CODE_TASKS = (
    ("count_vowels", "text: str", "int", "Count the vowels in a string."),
    ("is_prime", "n: int", "bool", "Return True if n is a prime number."),
    ("interleave", "a: list[int], b: list[int]", "list[int]", "Alternate the items of two lists into one list."),
    ("word_frequencies", "text: str", "dict[str, int]", "Count how often each word appears in a text."),
    ("unique_sorted", "items: list[int]", "list[int]", "Return the distinct items in ascending order."),
    ("kilometres_to_miles", "kilometres: float", "float", "Convert a distance from kilometres to miles."),
    ("gcd", "a: int, b: int", "int", "Return the greatest common divisor of a and b."),
    ("remove_duplicates", "items: list", "list", "Remove duplicates from a list, keeping the first occurrence."),
    ("triangle_number", "n: int", "int", "Return the n-th triangle number, 1 + 2 + ... + n."),
    ("chunk", "items: list, size: int", "list[list]", "Split a list into chunks of the given size."),
    ("capitalize_words", "sentence: str", "str", "Capitalize the first letter of every word."),
    ("second_largest", "numbers: list[int]", "int", "Return the second largest distinct number in the list."),
    ("read_csv_rows", "path: str", "list[dict]", "Read a CSV file and return its rows as dictionaries."),
    ("run_length_encode", "text: str", "str", "Compress a string with run-length encoding, e.g. aaab -> a3b1."),
    ("transpose", "matrix: list[list[int]]", "list[list[int]]", "Return the transpose of a matrix."),
    ("is_anagram", "a: str, b: str", "bool", "Return True if the two strings are anagrams of each other."),
    ("moving_average", "values: list[float], window: int", "list[float]", "Return the moving averages of values."),
    ("parse_duration", "text: str", "int", "Parse a duration such as '1h30m' and return it in seconds."),
    ("rotate_list", "items: list, k: int", "list", "Rotate a list to the right by k positions."),
    ("count_lines", "path: str", "int", "Return the number of non-empty lines in a text file."),
    ("sum_of_digits", "n: int", "int", "Return the sum of the decimal digits of n."),
    ("validate_email", "address: str", "bool", "Return True if the address looks like a valid email address."),
    ("longest_word", "sentence: str", "str", "Return the longest word of a sentence."),
    ("matrix_multiply", "a: list[list[float]], b: list[list[float]]", "list[list[float]]",
     "Multiply two matrices given as lists of rows."),
)

LANGUAGES = ("Python", "JavaScript", "Go", "Rust", "Java", "C", "SQL", "Bash")
SPOKEN = ("French", "Spanish", "German", "Italian", "Portuguese")
TONES = ("formal", "friendly", "professional", "casual", "polite", "enthusiastic")
AUDIENCES = ("a ten-year-old", "a beginner", "a high school student", "my grandmother", "a busy manager",
             "someone who has never heard of it")
COUNTS = ("two", "three", "four", "five")

# {concept}, {a}/{b}, {activity}, {howto}, {n}, {audience}: filled by prompts.chat_prompt
CHAT_TEMPLATES = (
    "Explain {concept} to {audience}.", "What is {concept}? Keep it short.", "How does {concept} work?",
    "What is the difference between {a} and {b}?", "Give me {n} tips for {activity}.",
    "What are the pros and cons of {activity}?", "How do I {howto}?", "List {n} interesting facts about {concept}.",
    "Can you help me understand {concept}? I find it confusing.", "Why is {concept} important?",
    "Compare {a} and {b} in a short table.", "I want to get better at {activity}. Where should I start?",
    "Describe {concept} in one paragraph.", "What are common mistakes people make when {activity}?",
    "Write step-by-step instructions to {howto}.", "Tell me a fun fact about {concept}.",
    "Is it hard to {howto}? Explain briefly.", "What should a beginner know about {concept}?",
)

WRITING_TEMPLATES = (
    "Write a short story about {character} who {event}.", "Write a poem about {poem}.",
    "Write a haiku about {poem}.", "Write an email to {recipient} about {subject}.",
    "Write a product description for {product}.", "Write a short dialogue between {character} and {character2}.",
    "Describe {place} in vivid detail.", "Write the opening paragraph of a mystery set in {place}.",
    "Write a limerick about {character}.", "Write a diary entry of {character} who {event}.",
    "Write a {tone} message to {recipient} about {subject}.", "Tell a bedtime story about {character}.",
)

CODE_TEMPLATES = (
    "Write a Python function that does the following: {doc}", "Write a {language} program that {lower}",
    "How would you {lower_verb} in {language}? Show the code.", "Write unit tests for a function that {lower}",
    "Explain what this Python function does:\n\n{source}", "Find the bug in this code and fix it:\n\n{source}",
    "Add type hints and a docstring to this function:\n\n{source}", "Make this Python code faster:\n\n{source}",
)

TEXT_TEMPLATES = (
    "Summarize this text in {n} sentences:\n\n{paragraph}", "What is the main idea of the following text?\n\n"
    "{paragraph}", "Rewrite the following text in a {tone} tone:\n\n{paragraph}",
    "Give this paragraph a title:\n\n{paragraph}", "Make this text shorter:\n\n{paragraph}",
    "Turn this paragraph into a bulleted list:\n\n{paragraph}", "Translate into {spoken}:\n\n{sentence}",
    "Rewrite this sentence in the passive voice: {sentence}", "Fix the grammar of this sentence: {broken}",
    "Ask three questions about this text:\n\n{paragraph}", "Explain this to a child:\n\n{paragraph}",
)
